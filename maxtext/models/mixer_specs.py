"""The token-mixer specs a LayerKind's mixer names (MIXERS): grouped-query attention (and Gemma 4's variant of it), MLA and
its sparse form with the lightning indexer, Gated DeltaNet, and DeepSeek V4's compressed attention."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError
from maxtext.layers.attention import AttentionSpec
from maxtext.layers.compressed_attention import CompressedAttentionSpec
from maxtext.layers.gated_deltanet import GatedDeltaNetSpec
from maxtext.layers.mla import MLASpec
from maxtext.layers.mla import softmax_scale as mla_softmax_scale
from maxtext.layers.mla_sparse import IndexerSpec, SparseMLASpec
from maxtext.layers.rope import RopeSpec
from maxtext.models.common_specs import context_layout, family_of, norm, rope, rules
from maxtext.models.family import Family, LayerKind


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


MIXERS: dict[str, Callable[[MaxTextConfig, Family], Any]] = {
  "attention": attention,
  "mla": lambda config, family: mla(config),
  "gated_deltanet": lambda config, family: gated_deltanet(config, family),
  "mla_sparse": lambda config, family: mla_sparse(config),
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
