"""Grouped-query self-attention with rotary embeddings, optional QK norm, soft cap and sliding window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.config import MaxTextConfig
from maxtext.layers import attention_ops, context_parallel, rope
from maxtext.layers.dtypes import dtype, precision
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.sharding import constrain
from maxtext.platform import Policy

if TYPE_CHECKING:
  from maxtext.inference.kv_cache import LayerCache


class Attention(nnx.Module):
  """Self-attention; the kernel comes from policy (maxtext.platform), window_choices lists the windows a traced
  (scanned, per-layer) window can take."""

  def __init__(self, config: MaxTextConfig, *, policy: Policy, rngs: nnx.Rngs, zero_centered_norm: bool = False, window_choices: Sequence[int] = ()):
    c = config
    self.config = c
    self.policy = policy
    self.window_choices = tuple(sorted(set(window_choices)))
    e, h, kv, d = c.emb_dim, c.num_query_heads, c.num_kv_heads, c.head_dim
    kw = dense_kwargs(c, policy, rngs)
    self.query = DenseGeneral((e,), (h, d), ("embed", "heads", "head_dim"), **kw)
    self.key = DenseGeneral((e,), (kv, d), ("embed", "kv_heads", "head_dim"), **kw)
    self.value = DenseGeneral((e,), (kv, d), ("embed", "kv_heads", "head_dim"), **kw)
    self.out = DenseGeneral((h, d), (e,), ("heads", "head_dim", "embed"), **kw)
    if c.use_qk_norm:
      nkw = dict(dtype=dtype(c.dtype), weight_dtype=dtype(c.weight_dtype), zero_centered=zero_centered_norm, logical_axis="head_dim")
      self.query_norm = RMSNorm(d, c.normalization_layer_epsilon, **nkw)
      self.key_norm = RMSNorm(d, c.normalization_layer_epsilon, **nkw)
    else:
      self.query_norm = self.key_norm = None
    self.scale = (c.query_pre_attn_scalar or d) ** -0.5
    self.context = context_parallel.Layout.of(c)
    # An explicit kernel that cannot run this model fails here, at build time, as a one-line config error.
    attention_ops.select(policy, dtype=dtype(c.dtype), head_dim=d, q_len=c.max_target_length, kv_len=c.max_target_length, soft_cap=c.attn_logits_soft_cap)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, window: int | jax.Array, cache: LayerCache | None = None):
    """-> output [B, S, E]; with a KV cache (decoding), -> (output, updated cache)."""
    rules = self.config.logical_axis_rules
    q = checkpoint_name(self.query(x), "query_proj")
    k = checkpoint_name(self.key(x), "key_proj")
    v = checkpoint_name(self.value(x), "value_proj")
    if self.query_norm is not None:
      q, k = self.query_norm(q), self.key_norm(k)
    c = self.config
    inv_freq = rope.inverse_frequencies(
      c.head_dim,
      c.rope_max_timescale,
      c.rope_type,
      c.rope_scaling_factor,
      c.rope_low_freq_factor,
      c.rope_high_freq_factor,
      c.rope_original_max_position_embeddings,
    )
    q = rope.apply_rope(q, positions, inv_freq)
    k = rope.apply_rope(k, positions, inv_freq)
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), rules)
    k = constrain(k, ("activation_batch", "activation_length", "activation_kv_heads", None), rules)
    v = constrain(v, ("activation_batch", "activation_length", "activation_kv_heads", None), rules)
    if cache is not None:
      ctx, cache = cache.attend(q, k, v, window, self.scale, c.attn_logits_soft_cap, precision(c.matmul_precision), rules)  # type: ignore[arg-type]
      return self.out(ctx), cache
    ctx = attention_ops.attend(
      q,
      k,
      v,
      q_positions=positions,
      kv_positions=positions,
      segment_ids=segment_ids,
      window=window,
      soft_cap=c.attn_logits_soft_cap,
      scale=self.scale,
      policy=self.policy,
      precision=precision(c.matmul_precision),
      window_choices=self.window_choices,
      rules=rules,
      context=self.context,
    )
    ctx = checkpoint_name(ctx, "context")
    return checkpoint_name(self.out(ctx), "out_proj")
