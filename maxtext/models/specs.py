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
from maxtext.layers.gated_deltanet import GatedDeltaNetSpec
from maxtext.layers.lora import LoRASpec
from maxtext.layers.mla import MLASpec
from maxtext.layers.mla import softmax_scale as mla_softmax_scale
from maxtext.layers.mlp import MLPSpec
from maxtext.layers.moe import MoESpec, RoutingSpec
from maxtext.layers.norms import NormSpec
from maxtext.layers.residual import ResidualSpec
from maxtext.layers.rope import RopeSpec
from maxtext.layers.sharding import Rules
from maxtext.models.decoder_layer import LayerSpec
from maxtext.models.family import Family, LayerKind
from maxtext.models.pipeline import Plan, Schedule


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
  sigmoid = c.routed_score_func == "sigmoid"
  routing = RoutingSpec(
    num_experts=c.num_experts,
    k=c.num_experts_per_tok,
    score_func=c.routed_score_func,
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
    router_bias=c.routed_bias and not sigmoid,  # gpt-oss: the router's own bias; deepseek: a score correction
    score_correction=c.routed_bias and sigmoid,
    expert_bias=c.mlp_bias,
    shared=mlp(c, c.shared_experts * c.moe_mlp_dim) if shared else None,
    shared_gate=shared and family.shared_expert_gate,
    capacity_factor=c.capacity_factor,
    wi_tiles=wi,
    wo_tiles=wo,
    rules=rules(c),
  )


def rope(config: MaxTextConfig, mla: bool = False) -> RopeSpec:
  """The rotary embedding of GQA layers, or of MLA's rotary part (mla=True)."""
  c = config
  return RopeSpec(
    kind=c.rope_type,
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
    interleave=c.rope_interleave and (mla or c.rope_type == "yarn"),  # split halves for every other rope
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
  return AttentionSpec(
    emb_dim=c.emb_dim,
    num_query_heads=c.num_query_heads,
    num_kv_heads=c.num_kv_heads,
    head_dim=c.head_dim,
    rope=rope(c),
    scale=(c.query_pre_attn_scalar or c.head_dim) ** -0.5,
    max_target_length=c.max_target_length,
    soft_cap=c.attn_logits_soft_cap,
    use_bias=c.attention_bias,
    sinks=c.attention_sink,
    qk_norm=norm(c, family) if c.use_qk_norm else None,
    output_gate=family.attention_output_gate,
    partial_rotary_factor=c.partial_rotary_factor,
    qk_norm_per_head=family.qk_norm_per_head,
    out_bias=family.attention_out_bias,
    window_choices=tuple(sorted(set(family.layer_windows(c)))),
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


def residual(config: MaxTextConfig) -> ResidualSpec:
  return ResidualSpec(config.emb_dim, config.mhc_expansion_rate, config.sinkhorn_iterations)


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
}
FEED_FORWARDS: dict[str, Callable[[MaxTextConfig, Family], Any]] = {
  "dense": lambda config, family: mlp(config),
  "moe": lambda config, family: moe(config, family, shared=False),
  "moe_shared": lambda config, family: moe(config, family, shared=True),
}


def layer(config: MaxTextConfig, family: Family, kind: LayerKind) -> LayerSpec:
  """One decoder layer of this kind (its window is a call argument, not part of the spec)."""
  c = config
  return LayerSpec(
    emb_dim=c.emb_dim,
    attention=MIXERS[kind.mixer](c, family),
    feed_forward=FEED_FORWARDS[kind.ffn](c, family),
    norm=norm(c, family),
    post_norms=family.post_norms,
    pre_norms=family.pre_norms,
    residual=residual(c),
    lora=lora(c),
    num_experts=c.num_experts,
    rules=rules(c),
  )


def pipeline(config: MaxTextConfig) -> Schedule | None:
  """The pipeline schedule around the main layer stack, or None without pipeline parallelism."""
  plan = Plan.of(config)
  if plan is None:
    return None
  fsdp_axes = frozenset(dict(rules(config)).get("embed", ()))  # the mesh axes the layers' 'embed' dimension is sharded over
  return Schedule(plan, rules(config), fsdp_axes, config.remat_policy, config.num_experts_per_tok)


@dataclasses.dataclass(frozen=True)
class ModelSpecs:
  """What the decoder around the layers builds from (maxtext.models.decoder)."""

  kinds: tuple[LayerKind, ...]  # the family's layer pattern: the kind of each decoder layer
  layers: tuple[LayerSpec, ...]  # each decoder layer's spec (layers of one structure share an equal spec)
  norm: NormSpec  # the final norm and the MTP modules' norms
  residual: ResidualSpec
  context: context_parallel.Layout | None  # context parallelism's sequence layout (its wrapper goes around the model call)
  pipeline: Schedule | None = None  # the pipeline schedule wrapped around the main layer stack

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
  return ModelSpecs(kinds, layers, norm(config, family), residual(config), context_layout(config), pipeline(config))
