"""Qwen3-VL checkpoints (Qwen3VLForConditionalGeneration, model_type qwen3_vl; qwen3_vl_moe): the text decoder is a
Qwen 3 (or Qwen3-MoE) decoder under text_config with multimodal rope, the vision tower lives at model.visual.*.

config.json: text_config -> the qwen3 / qwen3_moe keys (hf_config reads it as that model type), vision_config ->
the *_for_vit keys, rope_parameters.mrope_section -> use_mrope and mrope_section. Tensors: model.language_model.* and
lm_head.weight are the text decoder's (hf_checkpoint_tensors.text_decoder_tensors), model.visual.* the tower's
(maxtext.vision.convert.qwen3_vl_from_hf); export writes the same names back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from maxtext.convert.hf_fields import HFFields
from maxtext.errors import ConfigError
from maxtext.vision import convert as vision_convert

MODEL_TYPES = {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}  # config.json model_type -> the text decoder's model type
EXPORT_TYPES = {"qwen3": "qwen3_vl", "qwen3_moe": "qwen3_vl_moe"}
HF_TOWER_PREFIX = "model.visual."
HF_TEXT_PREFIX = "model.language_model."  # what save_pretrained writes for the decoder (lm_head.weight stays)
OURS_TOWER = "vision/tower/"  # the Transformer's Qwen3-VL encoder (maxtext.vision.qwen3_vl_encoder)
VISION_DEFAULTS = {  # Qwen3VLVisionConfig's defaults
  "depth": 27,
  "hidden_size": 1152,
  "intermediate_size": 4304,
  "num_heads": 16,
  "out_hidden_size": 3584,
  "patch_size": 16,
  "temporal_patch_size": 2,
  "spatial_merge_size": 2,
  "num_position_embeddings": 2304,
  "deepstack_visual_indexes": [8, 16, 24],
}


def text_config(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """The decoder's config.json fields, read as a qwen3 / qwen3_moe config."""
  text = {**HFFields(hf, source).section("text_config").values, "model_type": MODEL_TYPES[hf["model_type"]]}
  text["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)  # the top level's decides (a text_config may say otherwise)
  if hf["model_type"] == "qwen3_vl_moe":
    text["norm_topk_prob"] = True  # Qwen3VLMoe's router always renormalises the chosen experts' weights
  if "dtype" not in text and "torch_dtype" not in text:
    text["dtype"] = hf.get("dtype") or hf.get("torch_dtype")
  return text


def vision_overrides(hf: HFFields) -> dict[str, Any]:
  """vision_config, image_token_id and the text rope's mrope_section -> maxtext keys (use_multimodal=true)."""
  v = HFFields({**VISION_DEFAULTS, **hf.section("vision_config").values}, hf.source, "vision_config.")
  if v.int("in_channels", 3) != 3 or v.text("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
    raise ConfigError("config.json's vision_config differs from Qwen3-VL's tower (3 channels, gelu_pytorch_tanh); maxtext's tower has those")
  rope = hf.section("text_config").section("rope_parameters")
  section = rope.values.get("mrope_section", [24, 20, 20])
  if not rope.values.get("mrope_interleaved", True):
    raise ConfigError("config.json's text_config.rope_parameters sets mrope_interleaved=false; maxtext's multimodal rope interleaves (Qwen3-VL)")
  if not isinstance(section, list) or len(section) != 3 or not all(isinstance(s, int) and s >= 0 for s in section):
    raise ConfigError(f"{hf.source}: text_config.rope_parameters.mrope_section must be three counts, got {section!r}")
  deep = v.values.get("deepstack_visual_indexes") or []
  return {
    "use_multimodal": True,
    "vision_encoder_block": "qwen3_vl",
    "use_mrope": True,
    "mrope_section": list(section),
    "hidden_size_for_vit": v.int("hidden_size"),
    "intermediate_size_for_vit": v.int("intermediate_size"),
    "num_hidden_layers_for_vit": v.int("depth"),
    "num_attention_heads_for_vit": v.int("num_heads"),
    "out_hidden_size_for_vit": v.int("out_hidden_size"),
    "patch_size_for_vit": v.int("patch_size"),
    "temporal_patch_size_for_vit": v.int("temporal_patch_size"),
    "spatial_merge_size_for_vit": v.int("spatial_merge_size"),
    "num_position_embeddings_for_vit": v.int("num_position_embeddings"),
    "deepstack_visual_indexes_for_vit": [int(i) for i in deep],
    "image_token_id": hf.int("image_token_id", 151655, minimum=0),
  }


def tower_names(tower, prefix: str) -> list[str]:
  """The tensor names of a Qwen3VLVisionModel of this spec (Qwen3VLVisionSpec) under prefix."""
  merger = [f"{part}.{leaf}" for part in ("norm", "linear_fc1", "linear_fc2") for leaf in ("weight", "bias")]
  block = [f"{part}.{leaf}" for part in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2") for leaf in ("weight", "bias")]
  names = [prefix + n for n in ("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight")]
  names += [f"{prefix}merger.{n}" for n in merger]
  names += [f"{prefix}deepstack_merger_list.{j}.{n}" for j in range(len(tower.deepstack_indexes)) for n in merger]
  return names + [f"{prefix}blocks.{i}.{n}" for i in range(tower.num_layers) for n in block]


def vision_from_hf(tensors: Mapping[str, np.ndarray], spec) -> tuple[dict[str, np.ndarray], set[str]]:
  """The checkpoint's model.visual.* -> (the Transformer's flat vision parameters, the names consumed). spec:
  Qwen3VLEncoderSpec. Missing or misshapen tensors are ValueErrors naming them."""
  names = set(tower_names(spec.tower, HF_TOWER_PREFIX))
  missing = sorted(names - set(tensors))
  if missing:
    raise ValueError(f"the checkpoint is missing tensor '{missing[0]}' of the Qwen3-VL vision tower (num_hidden_layers_for_vit={spec.tower.num_layers})")
  try:
    tower = vision_convert.qwen3_vl_from_hf(tensors, spec.tower, HF_TOWER_PREFIX)
  except ValueError as e:
    raise ValueError(f"the vision tower's tensors do not fit the *_for_vit sizes ({e})") from None
  t = spec.tower
  expected = {
    "patch_embed/kernel": (t.num_channels, t.temporal_patch_size, t.patch_size, t.patch_size, t.emb_dim),
    "position_embed": (t.num_position_embeddings, t.emb_dim),
    "blocks/wi/kernel": (t.num_layers, t.emb_dim, t.mlp_dim),
    "merger/wb/kernel": (t.emb_dim * t.spatial_merge_size**2, t.out_dim),
  }
  for name, shape in expected.items():
    if tuple(tower[name].shape) != shape:
      raise ValueError(f"the vision tensor for {name} has shape {tuple(tower[name].shape)}; the *_for_vit keys give {shape}")
  return {OURS_TOWER + k: v for k, v in tower.items()}, names


def vision_to_hf(params: Mapping[str, np.ndarray], spec) -> dict[str, np.ndarray]:
  tower = {k[len(OURS_TOWER) :]: v for k, v in params.items() if k.startswith(OURS_TOWER)}
  return vision_convert.qwen3_vl_to_hf(tower, spec.tower, HF_TOWER_PREFIX)


def text_names_to_hf(text: Mapping[str, np.ndarray], fuse_experts: bool = False) -> dict[str, np.ndarray]:
  """A causal LM's tensor names (model.*, lm_head.weight) -> Qwen3VLForConditionalGeneration's; fuse_experts
  (qwen3_vl_moe): each layer's per-expert projections joined as Qwen3VLMoe stores them (fused_experts' inverse)."""
  out = {(HF_TEXT_PREFIX + k[len("model.") :] if k.startswith("model.") else k): v for k, v in text.items()}
  return _fuse_experts(out) if fuse_experts else out


FUSED = ".mlp.experts.gate_up_proj"  # [E, 2 I, H]: each expert's gate rows then its up rows
FUSED_DOWN = ".mlp.experts.down_proj"  # [E, H, I]


def split_experts(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Qwen3VLMoe's fused expert tensors -> the per-expert names of a Qwen3-MoE checkpoint (slices: bit-exact); other
  tensors unchanged."""
  out = {}
  for name, value in tensors.items():
    if name.endswith(FUSED):
      base, half = name[: -len(FUSED)], value.shape[1] // 2
      for j in range(value.shape[0]):
        out[f"{base}.mlp.experts.{j}.gate_proj.weight"] = np.ascontiguousarray(value[j, :half])
        out[f"{base}.mlp.experts.{j}.up_proj.weight"] = np.ascontiguousarray(value[j, half:])
    elif name.endswith(FUSED_DOWN):
      base = name[: -len(FUSED_DOWN)]
      for j in range(value.shape[0]):
        out[f"{base}.mlp.experts.{j}.down_proj.weight"] = np.ascontiguousarray(value[j])
    else:
      out[name] = value
  return out


def _fuse_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  out, experts = {}, {}
  for name, value in tensors.items():
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
      out[name] = value
      continue
    j, _, proj = tail.partition(".")
    experts.setdefault(head, {}).setdefault(proj, {})[int(j)] = value
  for head, projs in experts.items():
    n = len(projs["gate_proj.weight"])
    out[head + FUSED] = np.stack([np.concatenate([projs["gate_proj.weight"][j], projs["up_proj.weight"][j]]) for j in range(n)])
    out[head + FUSED_DOWN] = np.stack([projs["down_proj.weight"][j] for j in range(n)])
  return out


def export(c, text: dict[str, Any]) -> dict[str, Any]:
  """The text config.json nested as a Qwen3VLForConditionalGeneration's text_config, with its vision_config."""
  model_type = EXPORT_TYPES[c.decoder_block]
  text = {k: v for k, v in text.items() if k != "architectures"}
  text["model_type"] = model_type + "_text"
  rope = dict(text.pop("rope_parameters", None) or {"rope_type": "default", "rope_theta": c.rope_max_timescale})
  text.pop("rope_theta", None)
  text.pop("rope_scaling", None)
  text["rope_parameters"] = {**rope, "mrope_section": list(c.mrope_section), "mrope_interleaved": True}
  vision = {
    "model_type": model_type + "_vision",
    "depth": c.num_hidden_layers_for_vit,
    "hidden_size": c.hidden_size_for_vit,
    "intermediate_size": c.intermediate_size_for_vit,
    "num_heads": c.num_attention_heads_for_vit,
    "out_hidden_size": c.out_hidden_size_for_vit,
    "patch_size": c.patch_size_for_vit,
    "temporal_patch_size": c.temporal_patch_size_for_vit,
    "spatial_merge_size": c.spatial_merge_size_for_vit,
    "num_position_embeddings": c.num_position_embeddings_for_vit,
    "deepstack_visual_indexes": list(c.deepstack_visual_indexes_for_vit),
    "in_channels": 3,
    "hidden_act": "gelu_pytorch_tanh",
  }
  arch = "Qwen3VLForConditionalGeneration" if model_type == "qwen3_vl" else "Qwen3VLMoeForConditionalGeneration"
  return {
    "architectures": [arch],
    "model_type": model_type,
    "text_config": text,
    "vision_config": vision,
    "image_token_id": c.image_token_id,
    "tie_word_embeddings": c.logits_via_embedding,
    "dtype": c.weight_dtype,
  }
