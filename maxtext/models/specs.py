"""The model's specs, built once from the config, the family and the platform policy: the only model code that reads
`MaxTextConfig`.

Each layer takes its spec (a small frozen dataclass defined beside the layer) and never sees the config; a family's
difference from another is a field of a spec, set here from the family (maxtext.models.family). The dtypes come
resolved in the policy (maxtext.platform.Dtypes).

The pattern's vocabulary lives here: MIXERS and FEED_FORWARDS build the spec of each token mixer and feed-forward a
family's LayerKinds name (maxtext.models.decoder_layer.MODULES maps each spec type to its layer module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from maxtext.config import MaxTextConfig
from maxtext.config.adapters import adapter_specs, max_rank
from maxtext.config.parallelism import axis_size
from maxtext.config.sections import LoRA as LoRASection
from maxtext.errors import ConfigError
from maxtext.layers import context_parallel
from maxtext.layers import grouped_matmul as gmm
from maxtext.layers.attention import AttentionSpec
from maxtext.layers.compressed_attention import CompressedAttentionSpec
from maxtext.layers.gated_deltanet import GatedDeltaNetSpec
from maxtext.layers.lora import LoRASpec
from maxtext.layers.mla import MLASpec
from maxtext.layers.mla import softmax_scale as mla_softmax_scale
from maxtext.layers.mla_sparse import IndexerSpec, SparseMLASpec
from maxtext.layers.mlp import MLPSpec
from maxtext.layers.moe import MoESpec, RoutingSpec
from maxtext.layers.norms import NormSpec
from maxtext.layers.residual import ResidualSpec
from maxtext.layers.rope import RopeSpec
from maxtext.layers.sharding import Rules
from maxtext.models import layer_pattern
from maxtext.models.decoder_layer import LayerSpec
from maxtext.models.family import Family, LayerKind
from maxtext.models.pipeline import STAGE_AXIS, Plan, Schedule
from maxtext.vision.gemma3_encoder import Gemma3VisionSpec
from maxtext.vision.gemma3_projector import Gemma3ProjectorSpec
from maxtext.vision.llama4_vision import Llama4VisionSpec
from maxtext.vision.qwen3_vl import Qwen3VLVisionSpec
from maxtext.vision.qwen3_vl_encoder import Qwen3VLEncoderSpec
from maxtext.vision.siglip import SiglipSpec


def rules(config: MaxTextConfig) -> Rules:
  """logical_axis_rules as nested tuples (hashable: specs sit in graphdefs)."""
  return tuple((name, tuple(axes)) for name, axes in config.logical_axis_rules)


def norm(config: MaxTextConfig, family: Family | None = None) -> NormSpec:
  return NormSpec(config.normalization_layer_epsilon, (family or family_of(config)).zero_centered_norms)


def mlp(config: MaxTextConfig, width: int | None = None) -> MLPSpec:
  """The dense MLP of width mlp_dim (or width)."""
  return MLPSpec(config.emb_dim, config.mlp_dim if width is None else width, tuple(config.mlp_activations), rules(config))


def grouped_tiles(config: MaxTextConfig) -> tuple[gmm.Tiles, gmm.Tiles]:
  """Megablox blocks (rows, contracted, produced) of wi_0/wi_1 and of wo, from MaxText's wi_tile_*/wo_tile_* keys."""
  c = config
  wi = gmm.Tiles(
    fwd=(c.wi_tile_fwd_batch_seq, c.wi_tile_fwd_embed_dim, c.wi_tile_fwd_mlp_dim),
    dlhs=(c.wi_tile_dlhs_batch_seq, c.wi_tile_dlhs_mlp_dim, c.wi_tile_dlhs_embed_dim),
    drhs=(c.wi_tile_drhs_batch_seq, c.wi_tile_drhs_embed_dim, c.wi_tile_drhs_mlp_dim),
  )
  wo = gmm.Tiles(
    fwd=(c.wo_tile_fwd_batch_seq, c.wo_tile_fwd_mlp_dim, c.wo_tile_fwd_embed_dim),
    dlhs=(c.wo_tile_dlhs_batch_seq, c.wo_tile_dlhs_embed_dim, c.wo_tile_dlhs_mlp_dim),
    drhs=(c.wo_tile_drhs_batch_seq, c.wo_tile_drhs_mlp_dim, c.wo_tile_drhs_embed_dim),
  )
  return wi, wo


def family_of(config: MaxTextConfig) -> Family:
  from maxtext.models import registry

  return registry.get(config.decoder_block)


def moe(config: MaxTextConfig, family: Family | None = None, shared: bool | None = None) -> MoESpec:
  """The routed experts (num_experts > 1) and, with shared (default: shared_experts > 0), shared_experts shared experts;
  family defaults to decoder_block's."""
  c = config
  shared = bool(c.shared_experts) if shared is None else shared
  if shared and not c.shared_experts:
    raise ConfigError(f"decoder_block={c.decoder_block} has MoE layers with shared experts; set shared_experts >= 1")
  family = family or family_of(c)
  if family.expert_input_weights and c.num_experts_per_tok != 1:
    raise ConfigError(
      f"decoder_block={c.decoder_block} weights each expert's input, which is built for top-1 routing only; set num_experts_per_tok=1 (was {c.num_experts_per_tok})"
    )
  sigmoid = c.routed_score_func == "sigmoid" or family.expert_input_weights  # Llama 4's router: sigmoid of the top-1 logit
  per_expert = sigmoid or c.routed_score_func == "sqrtsoftplus"  # per-expert scores: routed_bias is a score correction
  routing = RoutingSpec(
    num_experts=c.num_experts,
    k=c.num_experts_per_tok,
    score_func="sigmoid" if sigmoid else c.routed_score_func,
    groups=c.n_routing_groups,
    topk_groups=c.topk_routing_group,
    renormalize=c.norm_topk_prob or family.renormalize_topk,
    scaling_factor=c.routed_scaling_factor,
  )
  wi, wo = grouped_tiles(c)
  return MoESpec(
    emb_dim=c.emb_dim,
    width=c.moe_mlp_dim,
    routing=routing,
    activations=tuple(c.mlp_activations),
    glu_limit=float(c.mlp_activations_limit) if family.clamped_glu else 0.0,
    router_bias=c.routed_bias and not per_expert,  # gpt-oss: the router's own bias; deepseek: a score correction
    score_correction=c.routed_bias and per_expert,
    expert_bias=c.mlp_bias,
    shared=(mlp(c) if family.experts_beside_dense_mlp else mlp(c, c.shared_experts * c.moe_mlp_dim)) if shared else None,
    shared_gate=shared and family.shared_expert_gate,
    input_weights=family.expert_input_weights,
    router_norm=norm(c, family) if family.experts_beside_dense_mlp else None,
    expert_scales=family.experts_beside_dense_mlp,
    separate_norms=norm(c, family) if family.experts_beside_dense_mlp else None,
    capacity_factor=c.capacity_factor,
    ragged_buffer_factor=c.ragged_buffer_factor,
    wi_tiles=wi,
    wo_tiles=wo,
    rules=rules(c),
  )


def rope(config: MaxTextConfig, mla: bool = False, family: Family | None = None) -> RopeSpec:
  """The rotary embedding of GQA layers, or of MLA's rotary part (mla=True); family: whose pairs may be interleaved."""
  c = config
  unscaled = c.rope_type == "llama3.1" and not c.rope_use_scale  # MaxText's rope_use_scale=false: llama3.1 without its scaling
  return RopeSpec(
    kind="default" if unscaled else c.rope_type,
    theta=c.rope_max_timescale,
    linear_scaling=c.rope_linear_scaling_factor,
    llama3_factor=c.rope_scaling_factor,
    low_freq_factor=c.rope_low_freq_factor,
    high_freq_factor=c.rope_high_freq_factor,
    llama3_original_max_position=c.rope_original_max_position_embeddings,
    yarn_factor=c.rope_factor,
    yarn_original_max_position=c.original_max_position_embeddings,
    beta_fast=c.beta_fast,
    beta_slow=c.beta_slow,
    truncate=c.rope_truncate,
    attention_scaling=c.rope_attention_scaling,
    local_theta=c.local_rope_max_timescale,
    interleave=(c.rope_interleave and (mla or c.rope_type == "yarn")) or (family is not None and family.interleaved_rope),  # else split halves
    mrope_section=tuple(c.mrope_section) if c.use_mrope else (),
  )


def context_layout(config: MaxTextConfig) -> context_parallel.Layout | None:
  """How context parallelism splits the sequence, or None without it."""
  shards = axis_size(config.ici_parallelism, config.dcn_parallelism, config.mesh_axes, context_parallel.CONTEXT_AXIS)
  if shards == 1:
    return None
  return context_parallel.Layout(shards, config.context_parallel_strategy, config.context_parallel_load_balance)


def attention(config: MaxTextConfig, family: Family | None = None) -> AttentionSpec:
  """Grouped-query attention; its traced windows are the family's layer windows."""
  c = config
  family = family or family_of(c)
  spans = family.layer_spans(c)
  if min(spans) < 0 and context_layout(c) is not None:
    raise ConfigError(
      f"decoder_block={c.decoder_block} has chunked-attention layers, which context parallelism does not build yet; set ici/dcn_context_parallelism=1"
    )
  l2 = family.l2_qk_norm and c.use_qk_norm
  return AttentionSpec(
    emb_dim=c.emb_dim,
    num_query_heads=c.num_query_heads,
    num_kv_heads=c.num_kv_heads,
    head_dim=c.head_dim,
    rope=rope(c, family=family),
    scale=family.softmax_scale if family.softmax_scale is not None else (c.query_pre_attn_scalar or c.head_dim) ** -0.5,
    max_target_length=c.max_target_length,
    soft_cap=c.attn_logits_soft_cap,
    use_bias=c.attention_bias,
    sinks=c.attention_sink,
    qk_norm=norm(c, family) if c.use_qk_norm and not l2 else None,
    output_gate=family.attention_output_gate,
    partial_rotary_factor=c.partial_rotary_factor,
    qk_norm_per_head=family.qk_norm_per_head,
    out_bias=family.attention_out_bias,
    nope_full_layers=family.nope_full_layers,
    l2_qk_norm_eps=c.normalization_layer_epsilon if l2 else 0.0,
    temperature_tuning=(c.temperature_tuning_scale, c.temperature_tuning_floor_scale) if c.temperature_tuning else None,
    window_choices=tuple(sorted(set(spans))),
    context=context_layout(c),
    rules=rules(c),
  )


def mla(config: MaxTextConfig) -> MLASpec:
  """Multi-head latent attention (DeepSeek)."""
  c = config
  rope_spec = rope(c, mla=True)
  return MLASpec(
    emb_dim=c.emb_dim,
    num_heads=c.num_query_heads,
    q_lora_rank=c.q_lora_rank,
    kv_lora_rank=c.kv_lora_rank,
    qk_nope_head_dim=c.qk_nope_head_dim,
    qk_rope_head_dim=c.qk_rope_head_dim,
    v_head_dim=c.v_head_dim,
    norm_epsilon=c.normalization_layer_epsilon,
    rope=rope_spec,
    scale=mla_softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, rope_spec, c.mscale),
    max_target_length=c.max_target_length,
    soft_cap=c.attn_logits_soft_cap,
    context=context_layout(c),
    rules=rules(c),
  )


def indexer_warmup(config: MaxTextConfig) -> bool:
  """The dense warm-up of DeepSeek Sparse Attention's indexer: a KL loss and indexer_sparse_training=false. The main
  attention then stays dense and only the indexer trains (maxtext.train.trainable)."""
  return config.use_indexer and config.indexer_loss_scaling_factor > 0 and not config.indexer_sparse_training


def mla_sparse(config: MaxTextConfig) -> SparseMLASpec:
  """MLA with DeepSeek Sparse Attention's lightning indexer, from MaxText's indexer_* keys."""
  c = config
  if context_layout(c) is not None:
    raise ConfigError(
      f"decoder_block={c.decoder_block} selects each query's top-k keys over the whole sequence, which context parallelism does not split yet; "
      "set ici/dcn_context_parallelism=1"
    )
  indexer = IndexerSpec(
    num_heads=c.indexer_n_heads,
    head_dim=c.indexer_head_dim,
    topk=c.indexer_topk,
    loss_scale=c.indexer_loss_scaling_factor,
    dense_warmup=indexer_warmup(c),
  )
  return SparseMLASpec(mla(c), indexer)


def gated_deltanet(config: MaxTextConfig, family: Family | None = None) -> GatedDeltaNetSpec:
  """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), from MaxText's gdn_* keys."""
  c = config
  family = family or family_of(c)
  if context_layout(c) is not None:
    raise ConfigError(
      f"decoder_block={c.decoder_block} has Gated DeltaNet layers, whose state does not pass between context shards yet; "
      "set ici/dcn_context_parallelism=1 (shard the batch with data or fsdp parallelism instead)"
    )
  if c.gdn_num_value_heads % c.gdn_num_key_heads:
    raise ConfigError(f"gdn_num_value_heads={c.gdn_num_value_heads} is not a multiple of gdn_num_key_heads={c.gdn_num_key_heads}; make it one")
  return GatedDeltaNetSpec(
    emb_dim=c.emb_dim,
    num_key_heads=c.gdn_num_key_heads,
    num_value_heads=c.gdn_num_value_heads,
    key_head_dim=c.gdn_key_head_dim,
    value_head_dim=c.gdn_value_head_dim,
    conv_kernel=c.gdn_conv_kernel_dim,
    chunk_size=c.gdn_chunk_size,
    norm_epsilon=c.normalization_layer_epsilon,
    split_projections=family.split_linear_projections,
    rules=rules(c),
  )


def compressed_attention(config: MaxTextConfig, kind: LayerKind) -> CompressedAttentionSpec:
  """DeepSeek V4's attention of this kind (its layer type and compress rate): the sliding layers rotate with
  rope_max_timescale unscaled, the compressed ones with compressed_rope_max_timescale and rope_type's scaling."""
  c = config
  if context_layout(c) is not None:
    raise ConfigError(f"decoder_block={c.decoder_block}'s compressed attention does not split the sequence yet; set ici/dcn_context_parallelism=1")
  try:
    return CompressedAttentionSpec(
      emb_dim=c.emb_dim,
      num_heads=c.num_query_heads,
      head_dim=c.head_dim,
      rope_dim=c.qk_rope_head_dim,
      q_lora_rank=c.q_lora_rank,
      o_groups=c.o_groups,
      o_lora_rank=c.o_lora_rank,
      window=c.sliding_window_size,
      layer_type=kind.variant,
      compress_rate=kind.compress,
      index_heads=c.indexer_n_heads,
      index_head_dim=c.indexer_head_dim,
      index_topk=c.indexer_topk,
      rope=RopeSpec(theta=c.rope_max_timescale),
      compress_rope=dataclasses.replace(rope(c), theta=c.compressed_rope_max_timescale, local_theta=0.0, interleave=True),
      epsilon=c.normalization_layer_epsilon,
    )
  except ValueError as e:
    raise ConfigError(f"decoder_block={c.decoder_block}: {e}; fix compress_ratios, o_groups or the head keys") from None


def deepseek4_moe(config: MaxTextConfig, family: Family, hashed: bool) -> MoESpec:
  """DeepSeek V4's experts beside shared ones, both with its clamped SwiGLU act0(min(h0, L)) * act1(clip(h1, -L, L))
  (L = mlp_activations_limit); hashed: experts fixed per token id by a tid2eid table of vocab_size rows, no score
  correction."""
  c = config
  spec = moe(c, family, shared=True)
  limit = float(c.mlp_activations_limit)
  shared = dataclasses.replace(spec.shared, glu_limit=limit, glu_clamp_only=True)
  return dataclasses.replace(
    spec,
    glu_limit=limit,
    glu_clamp_only=True,
    shared=shared,
    hash_vocab=c.vocab_size if hashed else 0,
    score_correction=spec.score_correction and not hashed,
  )


def residual(config: MaxTextConfig, family: Family | None = None) -> ResidualSpec:
  """The plain residual or mHC; DeepSeek V4's mHC form (hc_eps, its RMSNorm's epsilon the model's) for its family."""
  c = config
  if (family or family_of(c)).deepseek4_keys:
    return ResidualSpec(c.emb_dim, c.mhc_expansion_rate, c.sinkhorn_iterations, hc_eps=c.hc_eps, norm_eps=c.normalization_layer_epsilon)
  return ResidualSpec(c.emb_dim, c.mhc_expansion_rate, c.sinkhorn_iterations)


def lora(config: MaxTextConfig) -> LoRASpec | None:
  """The adapters of every decoder layer, or None without lora.enable_lora."""
  cfg = config.lora
  if not cfg.enable_lora:
    return None
  if cfg.max_lora_adapters == 1:
    ranks, top = (cfg.lora_rank,), cfg.lora_rank
  else:
    ranks, top = tuple(slot.rank for slot in adapter_specs(config)), max_rank(config)
  default = LoRASection.model_fields["lora_module_path"].default
  return LoRASpec(cfg.lora_module_path, cfg.lora_alpha, ranks, top, default_path=cfg.lora_module_path == default)


MIXERS: dict[str, Callable[[MaxTextConfig, Family], Any]] = {
  "attention": attention,
  "mla": lambda config, family: mla(config),
  "gated_deltanet": lambda config, family: gated_deltanet(config, family),
  "mla_sparse": lambda config, family: mla_sparse(config),
}
FEED_FORWARDS: dict[str, Callable[[MaxTextConfig, Family], Any]] = {
  "dense": lambda config, family: mlp(config),
  "moe": lambda config, family: moe(config, family, shared=False),
  "moe_shared": lambda config, family: deepseek4_moe(config, family, hashed=False) if family.deepseek4_keys else moe(config, family, shared=True),
  "moe_hash": lambda config, family: deepseek4_moe(config, family, hashed=True),
}


def gemma4_attention(config: MaxTextConfig, kind: LayerKind, spec: AttentionSpec) -> AttentionSpec:
  """Gemma 4's attention of this kind: value norm; global layers with global_head_dim, global_num_kv_heads,
  share_kv_projections and the global rope, sliding layers with the local rope (each its own proportion); KV-shared
  layers without key/value projections."""
  c, full = config, kind.variant == "global"
  theta = c.global_rope_max_timescale if full else c.local_rope_max_timescale
  rope_spec = dataclasses.replace(
    spec.rope, theta=theta if theta > 0 else c.rope_max_timescale, local_theta=0.0, proportion=c.global_rope_proportion if full else c.local_rope_proportion
  )
  return dataclasses.replace(
    spec,
    head_dim=(c.global_head_dim or c.head_dim) if full else c.head_dim,
    num_kv_heads=(c.global_num_kv_heads or c.num_kv_heads) if full else c.num_kv_heads,
    rope=rope_spec,
    qk_norm=norm(c),
    value_norm=norm(c),
    value_norm_scale=c.v_norm_with_scale,
    values_from_keys=full and c.share_kv_projections,
    kv_shared=kind.kv_shared,
  )


def layer(config: MaxTextConfig, family: Family, kind: LayerKind) -> LayerSpec:
  """One decoder layer of this kind (its window is a call argument, not part of the spec)."""
  c = config
  mixer = compressed_attention(c, kind) if kind.mixer == "compressed" else MIXERS[kind.mixer](c, family)
  ffn = FEED_FORWARDS[kind.ffn](c, family)
  if family.gemma4_keys and kind.mixer == "attention":
    mixer = gemma4_attention(c, kind, mixer)
  if kind.kv_shared and c.use_double_wide_mlp and isinstance(ffn, MLPSpec):
    ffn = dataclasses.replace(ffn, width=2 * ffn.width)
  elif kind.kv_shared and c.use_double_wide_mlp and isinstance(ffn, MoESpec) and ffn.shared is not None:  # the dense MLP beside the experts
    ffn = dataclasses.replace(ffn, shared=dataclasses.replace(ffn.shared, width=2 * ffn.shared.width))
  return LayerSpec(
    emb_dim=c.emb_dim,
    attention=mixer,
    feed_forward=ffn,
    per_layer_input=c.hidden_size_per_layer_input,
    layer_scalar=family.layer_scalar,
    norm=norm(c, family),
    post_norms=family.post_norms,
    pre_norms=family.pre_norms,
    residual=residual(c, family),
    lora=lora(c),
    num_experts=c.num_experts,
    rules=rules(c),
  )


def pipeline_plan(config: MaxTextConfig) -> Plan | None:
  """The config's pipeline plan, or None without pipeline parallelism. A main stack that repeats a block of p > 1
  different layers (qwen3_next: 3 Gated DeltaNet layers + 1 attention layer) is pipelined block by block: each stage
  runs num_layers_per_pipeline_stage / p whole blocks per visit, and the layers after the last whole block run after
  the pipeline on every stage."""
  c = config
  stages = axis_size(c.ici_parallelism, c.dcn_parallelism, c.mesh_axes, STAGE_AXIS)
  if stages == 1:
    return None
  main = layer_pattern.stacks(family_of(c).kinds(c))[-1]
  p, lps, piped = main.period, c.num_layers_per_pipeline_stage, c.pipeline_parallel_layers
  if p > 1:
    if lps % p:
      raise ConfigError(
        f"decoder_block={c.decoder_block} repeats a block of {p} different layers, which each stage runs whole: num_layers_per_pipeline_stage "
        f"{lps} is not a multiple of {p}; set it to a multiple of {p}"
      )
    if piped != main.num_groups * p:
      raise ConfigError(
        f"decoder_block={c.decoder_block} pipelines its whole blocks of {p} layers: pipeline_parallel_layers {piped} is not their "
        f"{main.num_groups} x {p} = {main.num_groups * p} layers; set pipeline_parallel_layers={main.num_groups * p}, or -1 when that is all layers"
      )
    if any(k.kv_shared for k in main.kinds) or c.hidden_size_per_layer_input:
      raise ConfigError(f"decoder_block={c.decoder_block}'s KV sharing or per-layer inputs do not run under the pipeline; set ici/dcn_pipeline_parallelism=1")
  return Plan(
    stages,
    c.num_pipeline_repeats,
    lps // p,
    c.num_pipeline_microbatches,
    2 if c.pipeline_delay_activation_forwarding else 1,
    c.pipeline_fsdp_ag_once,
    0 if p > 1 else c.num_decoder_layers - c.first_num_dense_layers - piped,
    p,
    len(main.remainder),
  )


def pipeline(config: MaxTextConfig) -> Schedule | None:
  """The pipeline schedule around the main layer stack, or None without pipeline parallelism."""
  plan = pipeline_plan(config)
  if plan is None:
    return None
  fsdp_axes = frozenset(dict(rules(config)).get("embed", ()))  # the mesh axes the layers' 'embed' dimension is sharded over
  return Schedule(plan, rules(config), fsdp_axes, config.remat_policy, config.num_experts_per_tok)


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


@dataclasses.dataclass(frozen=True)
class ModelSpecs:
  """What the decoder around the layers builds from (maxtext.models.decoder)."""

  kinds: tuple[LayerKind, ...]  # the family's layer pattern: the kind of each decoder layer
  layers: tuple[LayerSpec, ...]  # each decoder layer's spec (layers of one structure share an equal spec)
  norm: NormSpec  # the final norm and the MTP modules' norms
  residual: ResidualSpec
  context: context_parallel.Layout | None  # context parallelism's sequence layout (its wrapper goes around the model call)
  pipeline: Schedule | None = None  # the pipeline schedule wrapped around the main layer stack
  vision: Gemma3VisionSpec | Qwen3VLEncoderSpec | Llama4VisionSpec | None = None  # the image encoder (use_multimodal), or None

  @property
  def layer(self) -> LayerSpec:
    """The spec the MTP modules' layers are built like: the last decoder layer with attention (a Gated DeltaNet
    layer's state has no place in an MTP module; Qwen3-Next's and Qwen3.5's MTP layers are full attention)."""
    last = next((i for i in reversed(range(len(self.kinds))) if self.kinds[i].mixer != "gated_deltanet"), len(self.kinds) - 1)
    return self.layers[last]


def model(config: MaxTextConfig, family: Family | None = None) -> ModelSpecs:
  family = family or family_of(config)
  kinds = family.kinds(config)
  by_structure = {k.structure: layer(config, family, k) for k in dict.fromkeys(kinds)}
  layers = tuple(by_structure[k.structure] for k in kinds)
  return ModelSpecs(kinds, layers, norm(config, family), residual(config, family), context_layout(config), pipeline(config), vision(config))


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
  """All the Transformer (maxtext.models.decoder) reads, read from the config once: frozen and hashable, it sits in
  the model's graphdef where the 273-field config would otherwise."""

  model: ModelSpecs  # the layers, the final norm, the residual stream, context parallelism, the pipeline
  decoder_block: str  # the family's name (for error messages)
  vocab_size: int
  emb_dim: int
  scan_layers: bool
  remat_policy: str
  scale_embedding: bool  # the family scales token embeddings by sqrt(emb_dim) (Gemma)
  logits_via_embedding: bool  # the output head is the embedding table, transposed
  normalize_embedding_logits: bool  # with tied embeddings, logits divided by sqrt(emb_dim)
  final_logits_soft_cap: float  # 0: off
  logits_dot_in_fp32: bool
  quantize_logits_proj: bool
  num_vocab_tiling: int
  mtp_num_layers: int
  load_balance_loss_weight: float  # divided by num_decoder_layers, summed over layers
  num_decoder_layers: int
  hidden_size_per_layer_input: int  # Gemma 4's per-layer inputs: each layer's width (0: none)
  vocab_size_per_layer_input: int  # their table's rows (0: vocab_size)
  rules: Rules


def decoder(config: MaxTextConfig, family: Family | None = None) -> DecoderSpec:
  """The Transformer's spec (maxtext.models.build hands the config here; the model never sees it)."""
  c = config
  family = family or family_of(c)
  return DecoderSpec(
    model=model(c, family),
    decoder_block=c.decoder_block,
    vocab_size=c.vocab_size,
    emb_dim=c.emb_dim,
    scan_layers=c.scan_layers,
    remat_policy=c.remat_policy,
    scale_embedding=family.scale_embedding,
    logits_via_embedding=c.logits_via_embedding,
    normalize_embedding_logits=c.normalize_embedding_logits,
    final_logits_soft_cap=float(c.final_logits_soft_cap or 0.0),
    logits_dot_in_fp32=c.logits_dot_in_fp32,
    quantize_logits_proj=c.quantize_logits_proj,
    num_vocab_tiling=c.num_vocab_tiling,
    mtp_num_layers=c.mtp_num_layers,
    load_balance_loss_weight=c.load_balance_loss_weight,
    num_decoder_layers=c.num_decoder_layers,
    hidden_size_per_layer_input=c.hidden_size_per_layer_input or 0,
    vocab_size_per_layer_input=c.vocab_size_per_layer_input or 0,
    rules=rules(c),
  )
