"""Llama4ForConditionalGeneration's config.json <-> the llama4 *_for_vit keys (maxtext.convert.hf_config and hf_config_export call these
for model_type llama4 with a vision_config)."""

from __future__ import annotations

from typing import Any

from maxtext.convert.hf_fields import HFFields
from maxtext.errors import ConfigError

# Llama4VisionConfig's defaults for the fields a config.json may leave out
VISION_DEFAULTS = {
  "hidden_size": 768,
  "intermediate_size": 5632,
  "num_hidden_layers": 34,
  "num_attention_heads": 16,
  "image_size": 448,
  "patch_size": 14,
  "pixel_shuffle_ratio": 0.5,
  "projector_input_dim": 4096,
  "projector_output_dim": 4096,
  "vision_output_dim": 7680,
}


def llama4_vision_keys(hf: HFFields) -> dict[str, Any]:
  """vision_config and image_token_index -> use_multimodal=true and the llama4 *_for_vit keys (pass use_multimodal=false
  to load the text decoder alone)."""
  v = HFFields({**VISION_DEFAULTS, **hf.section("vision_config").values}, hf.source, "vision_config.")
  rope = v.section("rope_parameters")
  if v.int("num_channels", 3) != 3 or v.text("hidden_act", "gelu") != "gelu" or v.flag("multi_modal_projector_bias", False):
    raise ConfigError("config.json's vision_config differs from Llama 4's (3 channels, gelu, no projector bias); maxtext's tower has those")
  return {
    "use_multimodal": True,
    "tile_size_for_vit": v.int("image_size"),
    "patch_size_for_vit": v.int("patch_size"),
    "hidden_size_for_vit": v.int("hidden_size"),
    "intermediate_size_for_vit": v.int("intermediate_size"),
    "num_hidden_layers_for_vit": v.int("num_hidden_layers"),
    "num_attention_heads_for_vit": v.int("num_attention_heads"),
    "pixel_shuffle_ratio_for_vit": v.number("pixel_shuffle_ratio", positive=True),
    "projector_input_dim_for_vit": v.int("projector_input_dim"),
    "projector_output_dim_for_vit": v.int("projector_output_dim"),
    "vision_output_dim_for_vit": v.int("vision_output_dim"),
    "rope_theta_for_vit": rope.number("rope_theta", v.number("rope_theta", 10000.0, positive=True), positive=True),
    "image_token_id": hf.int("image_token_index", 200092, minimum=0),
  }


def llama4_vision_export(c: Any, text: dict[str, Any]) -> dict[str, Any]:
  """use_multimodal: the text config.json nested as a Llama4ForConditionalGeneration's text_config, with its vision_config."""
  text = {**{k: v for k, v in text.items() if k != "architectures"}, "model_type": "llama4_text"}
  vision = {
    "model_type": "llama4_vision_model",
    "hidden_size": c.hidden_size_for_vit,
    "intermediate_size": c.intermediate_size_for_vit,
    "num_hidden_layers": c.num_hidden_layers_for_vit,
    "num_attention_heads": c.num_attention_heads_for_vit,
    "image_size": c.tile_size_for_vit,
    "patch_size": c.patch_size_for_vit,
    "num_channels": 3,
    "hidden_act": "gelu",
    "pixel_shuffle_ratio": c.pixel_shuffle_ratio_for_vit,
    "projector_input_dim": c.projector_input_dim_for_vit,
    "projector_output_dim": c.projector_output_dim_for_vit,
    "vision_output_dim": c.vision_output_dim_for_vit,
    "multi_modal_projector_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta_for_vit},
  }
  return {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": text,
    "vision_config": vision,
    "image_token_index": c.image_token_id,
    "tie_word_embeddings": c.logits_via_embedding,
    "dtype": c.weight_dtype,
  }
