"""The vision component's spec from the *_for_vit keys: Gemma 3's SigLIP and projector, Qwen3-VL's tower, Llama 4's tile encoder."""

from __future__ import annotations

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError
from maxtext.models.common_specs import context_layout, rules
from maxtext.models.pipeline_specs import pipeline_plan
from maxtext.vision.gemma3_encoder import Gemma3VisionSpec
from maxtext.vision.gemma3_projector import Gemma3ProjectorSpec
from maxtext.vision.llama4_vision import Llama4VisionSpec
from maxtext.vision.qwen3_vl import Qwen3VLVisionSpec
from maxtext.vision.qwen3_vl_encoder import Qwen3VLEncoderSpec
from maxtext.vision.siglip import SiglipSpec

VISION_FAMILIES = ("gemma3", "llama4")  # decoder_blocks whose vision component use_multimodal builds
QWEN3_VL_FAMILIES = ("qwen3", "qwen3_moe")  # decoder_blocks under vision_encoder_block=qwen3_vl
QWEN3_VL_IMAGE_PAD = 151655  # Qwen's <|image_pad|> token id


def qwen3_vl_vision(config: MaxTextConfig) -> Qwen3VLEncoderSpec:
  """Qwen3-VL's tower from the *_for_vit keys (vision_encoder_block=qwen3_vl)."""
  c = config
  if c.decoder_block not in QWEN3_VL_FAMILIES:
    raise ConfigError(f"vision_encoder_block=qwen3_vl needs decoder_block qwen3 or qwen3_moe, not {c.decoder_block}; fix decoder_block or vision_encoder_block")
  if not c.use_mrope:
    raise ConfigError("vision_encoder_block=qwen3_vl places image tokens by multimodal rope; set use_mrope=true")
  if c.out_hidden_size_for_vit != c.emb_dim:
    raise ConfigError(f"out_hidden_size_for_vit={c.out_hidden_size_for_vit} must equal the text width emb_dim={c.emb_dim}; set it so")
  if c.mhc_expansion_rate > 1:
    raise ConfigError(
      f"vision_encoder_block=qwen3_vl adds its DeepStack features to a single residual stream; set mhc_expansion_rate=1 (not {c.mhc_expansion_rate})"
    )
  if len(c.deepstack_visual_indexes_for_vit) > c.num_decoder_layers:
    raise ConfigError(f"{len(c.deepstack_visual_indexes_for_vit)} DeepStack indexes for {c.num_decoder_layers} decoder layers; give at most one per layer")
  try:
    tower = Qwen3VLVisionSpec(
      emb_dim=c.hidden_size_for_vit,
      mlp_dim=c.intermediate_size_for_vit,
      num_layers=c.num_hidden_layers_for_vit,
      num_heads=c.num_attention_heads_for_vit,
      out_dim=c.out_hidden_size_for_vit,
      patch_size=c.patch_size_for_vit,
      temporal_patch_size=c.temporal_patch_size_for_vit,
      spatial_merge_size=c.spatial_merge_size_for_vit,
      num_position_embeddings=c.num_position_embeddings_for_vit,
      deepstack_indexes=tuple(c.deepstack_visual_indexes_for_vit),
      rules=rules(c),
    )
  except ValueError as e:
    raise ConfigError(f"use_multimodal=true: {e}; fix the *_for_vit keys") from None
  if tower.grid_side**2 != tower.num_position_embeddings:
    raise ConfigError(f"num_position_embeddings_for_vit={c.num_position_embeddings_for_vit} is not a square number; make it one (Qwen3-VL: 2304)")
  # An image_token_id past the vocabulary (base.yml's default is Gemma 3's 262144) means Qwen's <|image_pad|>: MaxText's
  # model files leave it to the processor, and Qwen3-VL embeds its placeholder rows.
  image_token_id = c.image_token_id if c.image_token_id < c.vocab_size else QWEN3_VL_IMAGE_PAD
  return Qwen3VLEncoderSpec(tower, image_token_id, c.min_pixels_for_vit, c.image_size_for_vit**2, c.remat_policy_for_vit)


def vision(config: MaxTextConfig) -> Gemma3VisionSpec | Qwen3VLEncoderSpec | Llama4VisionSpec | None:
  """The vision component from the *_for_vit keys (Gemma 3's SigLIP and projector, Qwen3-VL's tower with
  vision_encoder_block=qwen3_vl, or Llama 4's tile encoder and projector), or None without use_multimodal."""
  c = config
  if not c.use_multimodal:
    return None
  if c.vision_encoder_block == "qwen3_vl":
    if pipeline_plan(c) is not None or context_layout(c) is not None:
      raise ConfigError(
        "use_multimodal=true does not run under pipeline or context parallelism yet; set ici/dcn_pipeline_parallelism=1 and ici/dcn_context_parallelism=1"
      )
    return qwen3_vl_vision(c)
  if c.decoder_block not in VISION_FAMILIES:
    raise ConfigError(
      f"use_multimodal=true: decoder_block={c.decoder_block} has no vision encoder here (only {', '.join(VISION_FAMILIES)}, or qwen3/qwen3_moe with vision_encoder_block=qwen3_vl); set use_multimodal=false"
    )
  if pipeline_plan(c) is not None or context_layout(c) is not None:
    raise ConfigError(
      "use_multimodal=true does not run under pipeline or context parallelism yet; set ici/dcn_pipeline_parallelism=1 and ici/dcn_context_parallelism=1"
    )
  if c.decoder_block == "llama4":
    return llama4_vision(c)
  try:
    tower = SiglipSpec(
      c.image_size_for_vit,
      c.patch_size_for_vit,
      c.hidden_size_for_vit,
      c.intermediate_size_for_vit,
      c.num_hidden_layers_for_vit,
      c.num_attention_heads_for_vit,
      rules=rules(c),
    )
    projector = Gemma3ProjectorSpec(tower.patches_per_side, c.hidden_size_for_vit, c.emb_dim, c.mm_tokens_per_image, rules=rules(c))
  except ValueError as e:
    raise ConfigError(f"use_multimodal=true: {e}; fix the *_for_vit keys or mm_tokens_per_image") from None
  return Gemma3VisionSpec(tower, projector, c.image_token_id, c.remat_policy_for_vit)


def llama4_vision(config: MaxTextConfig) -> Llama4VisionSpec:
  """Llama 4's tile encoder and projector from MaxText's llama4 *_for_vit keys."""
  c = config
  if not c.projector_input_dim_for_vit == c.projector_output_dim_for_vit == c.vision_output_dim_for_vit:
    raise ConfigError(
      f"use_multimodal=true: llama4's vision adapter maps projector_input_dim_for_vit={c.projector_input_dim_for_vit} to projector_output_dim_for_vit="
      f"{c.projector_output_dim_for_vit} and the projector reads vision_output_dim_for_vit={c.vision_output_dim_for_vit}; set all three equal"
    )
  try:
    return Llama4VisionSpec(
      tile_size=c.tile_size_for_vit,
      patch_size=c.patch_size_for_vit,
      emb_dim=c.hidden_size_for_vit,
      mlp_dim=c.intermediate_size_for_vit,
      num_layers=c.num_hidden_layers_for_vit,
      num_heads=c.num_attention_heads_for_vit,
      adapter_dim=c.projector_input_dim_for_vit,
      text_dim=c.emb_dim,
      image_token_id=c.image_token_id,
      pixel_shuffle_ratio=c.pixel_shuffle_ratio_for_vit,
      rope_theta=c.rope_theta_for_vit,
      remat_policy=c.remat_policy_for_vit,
      rules=rules(c),
    )
  except ValueError as e:
    raise ConfigError(f"use_multimodal=true: {e}; fix the llama4 *_for_vit keys") from None
