"""Cross-field checks of the model keys that mean something only to some families (MoE, MLA, Gemma 4, DeepSeek V4, Llama 4, vision)."""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING

from maxtext.config.model_shape import layer_shape, mixers, scale_dims
from maxtext.errors import ConfigError

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig


def check_moe_fields(c: MaxTextConfig) -> None:
  """DeepSeek MoE, MLA, YaRN and MTP keys that only make sense together."""
  groups, topk_groups = c.n_routing_groups, c.topk_routing_group
  if (groups == -1) != (topk_groups == -1):
    raise ConfigError(f"n_routing_groups {groups} and topk_routing_group {topk_groups} must both be -1 (off) or both positive; set both")
  if groups != -1:
    if groups < 1 or c.num_experts % groups or not 1 <= topk_groups <= groups:
      raise ConfigError(
        f"group-limited routing needs n_routing_groups dividing num_experts {c.num_experts} and 1 <= topk_routing_group <= n_routing_groups; got {groups}, {topk_groups}"
      )
    if c.num_experts // groups < 2:
      raise ConfigError(
        f"group-limited routing scores each group by its top-2 experts, but {c.num_experts} experts in {groups} groups leave fewer than 2 per group"
      )
  if c.capacity_factor != -1 and c.capacity_factor <= 0:
    raise ConfigError(f"invalid value for 'capacity_factor': {c.capacity_factor}; use -1 (dropless) or a positive number")
  if c.expert_gather_chunks > 1 and not c.sparse_matmul:
    raise ConfigError(
      f"expert_gather_chunks={c.expert_gather_chunks} chunks the sparse dispatch's grouped matmuls; set sparse_matmul=true, or expert_gather_chunks=0"
    )
  if c.expert_gather_chunks > 1 and c.num_experts % c.expert_gather_chunks:
    raise ConfigError(f"expert_gather_chunks={c.expert_gather_chunks} does not divide num_experts={c.num_experts}; pick a divisor, or 0 to choose by size")
  if c.ragged_buffer_factor != -1 and c.ragged_buffer_factor <= 0:
    raise ConfigError(f"invalid value for 'ragged_buffer_factor': {c.ragged_buffer_factor}; use -1 (worst-case buffer, dropless) or a positive number")
  if c.num_experts > 1 and c.sparse_matmul and c.megablox and c.use_tokamax_gmm and importlib.util.find_spec("tokamax") is None:
    raise ConfigError("use_tokamax_gmm=true needs the tokamax package; pip install tokamax (or the `tpu` extra), or set use_tokamax_gmm=false")
  if c.routed_bias_update_rate > 0 and not c.routed_bias:
    raise ConfigError("routed_bias_update_rate > 0 updates the routing bias, but routed_bias is false; set routed_bias=true")
  if c.base_moe_mlp_dim != -1 and c.base_moe_mlp_dim < 1:
    raise ConfigError(f"invalid value for 'base_moe_mlp_dim': {c.base_moe_mlp_dim}; use -1 (= base_mlp_dim) or a positive integer")
  moe_only = {"shared_experts": c.shared_experts, "first_num_dense_layers": c.first_num_dense_layers, "n_routing_groups": max(groups, 0)}
  if c.num_experts == 1 and any(moe_only.values()):
    raise ConfigError(f"{', '.join(k for k, v in moe_only.items() if v)} need experts, but num_experts is 1; set num_experts > 1")
  if c.first_num_dense_layers >= c.base_num_decoder_layers * scale_dims(c.global_parameter_scale)["layers"]:
    raise ConfigError(f"first_num_dense_layers {c.first_num_dense_layers} leaves no MoE layer; lower it below the number of decoder layers")
  if c.routed_bias_update_rate > 0 and c.routed_score_func not in ("sigmoid", "sqrtsoftplus"):
    raise ConfigError(
      "routed_bias_update_rate > 0 moves a score-correction bias, which needs routed_score_func=sigmoid or sqrtsoftplus (with softmax scores routed_bias is a trained router bias)"
    )
  if c.mlp_bias and c.num_experts == 1:
    raise ConfigError("mlp_bias adds biases to routed experts, but num_experts is 1 (dense MLPs have none here); set num_experts > 1 or mlp_bias=false")
  if c.decoder_block in ("deepseek", "deepseek_v32") and (c.kv_lora_rank < 1 or c.qk_rope_head_dim < 2 or c.qk_rope_head_dim % 2 or c.v_head_dim < 1):
    raise ConfigError("deepseek MLA needs kv_lora_rank >= 1, an even qk_rope_head_dim >= 2 and v_head_dim >= 1; fix the MLA keys")


def check_family_fields(c: MaxTextConfig) -> None:
  """Attention and rope keys that need a family (or each other) to mean something."""
  from maxtext.models import registry  # the config loads before any model code otherwise

  family = registry.get(c.decoder_block)
  if c.attention_sink and not family.attention_sinks:
    with_sinks = sorted(f.name for f in registry.FAMILIES.values() if f.attention_sinks)
    raise ConfigError(
      f"attention_sink=true, but decoder_block={c.decoder_block} has no sink parameters (its checkpoints have none); sinks are for {', '.join(with_sinks)}: "
      "drop attention_sink"
    )
  if c.sliding_window_size and not any(family.layer_windows(layer_shape(c))):
    raise ConfigError(
      f"sliding_window_size={c.sliding_window_size}, but decoder_block={c.decoder_block}'s layer pattern has no sliding-window layer; set it to 0"
    )
  if (c.attention_bias or c.attention_sink) and {"mla", "mla_sparse"} & mixers(c):
    raise ConfigError(f"attention_bias and attention_sink apply to grouped-query attention; decoder_block={c.decoder_block} uses MLA, drop them")
  if c.mlp_activations_limit > 0 and not (family.clamped_glu or family.deepseek4_keys):
    with_glu = sorted(f.name for f in registry.FAMILIES.values() if f.clamped_glu or f.deepseek4_keys)
    raise ConfigError(f"mlp_activations_limit clamps the experts' SwiGLU of {', '.join(with_glu)}, not decoder_block={c.decoder_block}; set it to -1")
  if family.clamped_glu and not c.mlp_activations_limit > 0:
    raise ConfigError(f"decoder_block={c.decoder_block} clamps its experts' SwiGLU; set mlp_activations_limit > 0 (gpt-oss: 7.0)")
  if family.clamped_glu and len(c.mlp_activations) != 2:
    raise ConfigError(f"decoder_block={c.decoder_block} has gated experts; set mlp_activations to two entries, e.g. [sigmoid, linear]")
  if c.local_rope_max_timescale != -1 and c.local_rope_max_timescale <= 0:
    raise ConfigError(f"invalid value for 'local_rope_max_timescale': {c.local_rope_max_timescale}; use -1 (= rope_max_timescale) or a positive base")
  if c.rope_linear_scaling_factor != 1.0 and c.rope_type != "default":
    raise ConfigError(f"rope_linear_scaling_factor scales the default rope; rope_type={c.rope_type} has its own scaling: set one of the two")
  _check_gemma4_fields(c, family)
  _check_deepseek4_fields(c, family)


GEMMA4_KEYS = (
  "global_head_dim",
  "global_num_kv_heads",
  "share_kv_projections",
  "v_norm_with_scale",
  "global_rope_max_timescale",
  "global_rope_proportion",
  "local_rope_proportion",
  "hidden_size_per_layer_input",
  "vocab_size_per_layer_input",
  "num_kv_shared_layers",
  "use_double_wide_mlp",
)


def _check_gemma4_fields(c: MaxTextConfig, family) -> None:
  """Gemma 4's keys: only for a family that builds them, and KV sharing that its layer pattern can serve."""
  if not family.gemma4_keys:
    changed = [k for k in GEMMA4_KEYS if getattr(c, k) != type(c).model_fields[k].default]
    if changed:
      raise ConfigError(f"{', '.join(changed)} apply to gemma4 layers, not decoder_block={c.decoder_block}; drop them (or set decoder_block=gemma4)")
    return
  layers = layer_shape(c).num_decoder_layers
  if c.num_kv_shared_layers >= layers:
    raise ConfigError(f"num_kv_shared_layers={c.num_kv_shared_layers} leaves none of the {layers} layers to compute keys and values; make it < {layers}")
  kinds = family.kinds(layer_shape(c))
  sources = {k.window for k in kinds if not k.kv_shared}
  orphan = next((i for i, k in enumerate(kinds) if k.kv_shared and k.window not in sources), None)
  if orphan is not None:
    kind = "sliding-window" if kinds[orphan].window else "global"
    raise ConfigError(
      f"num_kv_shared_layers={c.num_kv_shared_layers}: layer {orphan} ({kind}) shares the keys and values of an earlier {kind} layer, but every {kind} "
      "layer is shared; lower num_kv_shared_layers"
    )
  if c.hidden_size_per_layer_input and 0 < c.vocab_size_per_layer_input < c.vocab_size:  # ids past the table would look up NaN rows
    raise ConfigError(
      f"vocab_size_per_layer_input={c.vocab_size_per_layer_input} leaves token ids {c.vocab_size_per_layer_input}..{c.vocab_size - 1} of "
      f"vocab_size={c.vocab_size} without a per-layer input row; set vocab_size_per_layer_input=0 (vocab_size) or >= {c.vocab_size}"
    )
  if c.hidden_size_per_layer_input and c.mhc_expansion_rate > 1:
    raise ConfigError("hidden_size_per_layer_input adds per-layer inputs to one residual stream; set mhc_expansion_rate=1 (or hidden_size_per_layer_input=0)")
  if c.mtp_num_layers:
    raise ConfigError(f"mtp_num_layers={c.mtp_num_layers}: multi-token prediction is not built for gemma4's layers; set mtp_num_layers=0")
  if c.num_experts > 1 and c.shared_experts != 1:
    raise ConfigError(
      f"shared_experts={c.shared_experts}: gemma4's experts run beside each layer's dense MLP of mlp_dim, its one shared expert; set shared_experts=1"
    )


DEEPSEEK4_KEYS = ("compress_ratios", "csa_compress_ratio", "o_groups", "o_lora_rank", "first_num_hash_layers", "compressed_rope_max_timescale", "hc_eps")


def _check_deepseek4_fields(c: MaxTextConfig, family) -> None:
  """DeepSeek V4's keys: only for its family, and a layer pattern, output projection and mHC its layers can build."""
  if not family.deepseek4_keys:
    changed = [k for k in DEEPSEEK4_KEYS if getattr(c, k) != type(c).model_fields[k].get_default(call_default_factory=True)]
    if changed:
      raise ConfigError(f"{', '.join(changed)} apply to deepseek4 layers, not decoder_block={c.decoder_block}; drop them (or set decoder_block=deepseek4)")
    return
  layers = layer_shape(c).num_decoder_layers
  if len(c.compress_ratios) != layers:
    raise ConfigError(
      f"compress_ratios has {len(c.compress_ratios)} entries for {layers} decoder layers; give one compress rate per layer (0: sliding window only)"
    )
  if any(r < 0 for r in c.compress_ratios):
    raise ConfigError(f"compress_ratios {c.compress_ratios} has a negative rate; use 0 (sliding window only) or a positive rate")
  if c.first_num_hash_layers > layers:
    raise ConfigError(f"first_num_hash_layers={c.first_num_hash_layers} exceeds the {layers} decoder layers; lower it")
  if not c.sliding_window_size > 0:
    raise ConfigError("decoder_block=deepseek4 attends within a sliding window in every layer; set sliding_window_size > 0 (V4: 128)")
  if not (c.o_groups > 0 and c.o_lora_rank > 0 and c.q_lora_rank > 0):
    raise ConfigError("decoder_block=deepseek4 projects queries through q_lora_rank and outputs through o_groups x o_lora_rank; set all three > 0")
  if c.mhc_expansion_rate < 2:
    raise ConfigError(f"decoder_block=deepseek4 keeps mHC's residual streams in every layer; set mhc_expansion_rate >= 2 (V4: 4), not {c.mhc_expansion_rate}")
  if c.num_experts <= 1 or c.shared_experts < 1:
    raise ConfigError("decoder_block=deepseek4's layers are experts beside shared experts; set num_experts > 1 and shared_experts >= 1")
  if not c.mlp_activations_limit > 0 or len(c.mlp_activations) != 2:
    raise ConfigError("decoder_block=deepseek4 clamps its gated experts' SwiGLU; set mlp_activations_limit > 0 (V4: 10) and two mlp_activations")
  if c.mtp_num_layers:
    raise ConfigError(f"mtp_num_layers={c.mtp_num_layers}: multi-token prediction is not built for deepseek4's layers; set mtp_num_layers=0")
  if c.quantize_kvcache:
    raise ConfigError("quantize_kvcache quantizes keys and values per head; deepseek4's compressed cache is not quantized here: set quantize_kvcache=false")


def check_indexer(c: MaxTextConfig) -> None:
  """DeepSeek Sparse Attention's keys: use_indexer exactly with the sparse MLA layers of decoder_block=deepseek_v32."""
  sparse = "mla_sparse" in mixers(c)
  if c.use_indexer and not sparse and "compressed" not in mixers(c):  # deepseek4's indexer: the indexer_* keys, in its CSA layers
    raise ConfigError(
      f"use_indexer=true, but decoder_block={c.decoder_block} has no sparse attention layers; "
      "MaxText's deepseek with use_indexer is decoder_block=deepseek_v32 here: set it, or use_indexer=false"
    )
  if sparse and not c.use_indexer:
    raise ConfigError(f"decoder_block={c.decoder_block} attends through the lightning indexer; set use_indexer=true (or decoder_block=deepseek for dense MLA)")
  if sparse and not c.q_lora_rank:
    raise ConfigError("DeepSeek Sparse Attention's indexer projects MLA's query latent; set q_lora_rank > 0")
  if sparse and c.indexer_head_dim < c.qk_rope_head_dim:
    raise ConfigError(f"indexer_head_dim={c.indexer_head_dim} is smaller than its rotary part qk_rope_head_dim={c.qk_rope_head_dim}; raise indexer_head_dim")


def check_llama4_fields(c: MaxTextConfig) -> None:
  """Llama 4's pattern keys mean something only to a family with its pattern (and rope_use_scale only to llama3.1 rope)."""

  from maxtext.models import family as family_lib
  from maxtext.models import registry  # the config loads before any model code otherwise

  if not c.rope_use_scale and c.rope_type != "llama3.1":
    raise ConfigError(f"rope_use_scale=false turns off llama3.1 rope's scaling, but rope_type={c.rope_type}; drop rope_use_scale")
  if registry.get(c.decoder_block).layer_pattern is not family_lib.llama4_pattern:
    for key, default in (("interleave_moe_layer_step", 1), ("nope_layer_interval", -1), ("chunk_attn_window_size", 0), ("temperature_tuning", False)):
      if getattr(c, key) != default:
        raise ConfigError(f"{key}={getattr(c, key)} shapes llama4's layer pattern, not decoder_block={c.decoder_block}'s; set it to {default}")
    return
  if c.nope_layer_interval == 0 or c.nope_layer_interval < -1:
    raise ConfigError(f"invalid value for 'nope_layer_interval': {c.nope_layer_interval}; use -1 (no NoPE layers) or a positive interval")
  if not c.chunk_attn_window_size:
    raise ConfigError("llama4's rope layers attend within chunks; set chunk_attn_window_size > 0 (8192 in the published models)")
  period = math.lcm(c.interleave_moe_layer_step, max(c.nope_layer_interval, 1))
  if c.inhomogeneous_layer_cycle_interval not in (1, period):
    raise ConfigError(
      f"inhomogeneous_layer_cycle_interval={c.inhomogeneous_layer_cycle_interval}, but llama4's pattern of interleave_moe_layer_step="
      f"{c.interleave_moe_layer_step} and nope_layer_interval={c.nope_layer_interval} repeats every {period} layers; set it to {period}"
    )


def check_vision_training(c: MaxTextConfig) -> None:
  """The llama4 *_for_vit keys mean something only to llama4; vision_learning_rate_scale needs a vision tower that trains
  (freeze_vision_encoder_params is MaxText's key, true in its base.yml, and does nothing without use_multimodal)."""
  from maxtext.config.model_sections import Llama4Vision

  if c.decoder_block != "llama4":
    for key, field in Llama4Vision.model_fields.items():
      if getattr(c, key) != field.default:
        raise ConfigError(f"{key}={getattr(c, key)} shapes llama4's vision tower, not decoder_block={c.decoder_block}'s; set it to {field.default}")
  if c.vision_learning_rate_scale == 1.0:
    return
  scale = f"vision_learning_rate_scale={c.vision_learning_rate_scale}"
  if not c.use_multimodal:
    raise ConfigError(f"{scale} scales the vision tower's learning rate, but use_multimodal=false builds none; drop it or set use_multimodal=true")
  if c.freeze_vision_encoder_params:
    raise ConfigError(f"{scale} scales the vision tower's learning rate, but freeze_vision_encoder_params=true freezes it; drop one of the two")
  if c.lora.enable_lora:
    raise ConfigError(f"{scale} scales the vision tower's learning rate, but with lora.enable_lora only the adapters train; drop it")
