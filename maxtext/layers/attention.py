"""Grouped-query self-attention with rotary embeddings, optional QK norm, biases, sinks, soft cap and sliding window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
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


def rotary(c: MaxTextConfig, dim: int, window: int | jax.Array) -> tuple[jax.Array, float]:
  """(inverse frequencies, cos/sin scale) of a layer with this window: local (sliding-window) layers may rotate with
  their own base (local_rope_max_timescale); a traced window picks between the two sets per layer."""
  inv_global, scale = rope.layer_frequencies(c, dim, local=False)
  if c.local_rope_max_timescale <= 0:
    return jnp.asarray(inv_global, jnp.float32), scale
  inv_local, local_scale = rope.layer_frequencies(c, dim, local=True)
  if isinstance(window, int):
    return jnp.asarray(inv_local if window else inv_global, jnp.float32), local_scale if window else scale
  if scale != local_scale:
    raise ValueError("a traced window needs one cos/sin scale for local and global layers")
  return jnp.where(jnp.asarray(window) > 0, jnp.asarray(inv_local, jnp.float32), jnp.asarray(inv_global, jnp.float32)), scale


class Attention(nnx.Module):
  """Self-attention; the kernel comes from policy (maxtext.platform), window_choices lists the windows a traced
  (scanned, per-layer) window can take. attention_bias adds q/k/v/o biases; attention_sink a sink logit per head."""

  def __init__(self, config: MaxTextConfig, *, policy: Policy, rngs: nnx.Rngs, zero_centered_norm: bool = False, window_choices: Sequence[int] = ()):
    c = config
    self.config = c
    self.policy = policy
    self.window_choices = tuple(sorted(set(window_choices)))
    e, h, kv, d = c.emb_dim, c.num_query_heads, c.num_kv_heads, c.head_dim
    kw = dict(dense_kwargs(c, policy, rngs), use_bias=c.attention_bias)
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
    self.sinks = nnx.Param(jnp.zeros((h,), dtype(c.weight_dtype)), logical_axes=("heads",)) if c.attention_sink else None
    self.scale = (c.query_pre_attn_scalar or d) ** -0.5
    self.context = context_parallel.Layout.of(c)
    # An explicit kernel that cannot run this model fails here, at build time, as a one-line config error.
    attention_ops.select(
      policy, dtype=dtype(c.dtype), head_dim=d, q_len=c.max_target_length, kv_len=c.max_target_length, soft_cap=c.attn_logits_soft_cap, sinks=c.attention_sink
    )

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, window: int | jax.Array, cache: LayerCache | None = None):
    """-> output [B, S, E]; with a KV cache (decoding), -> (output, updated cache)."""
    rules = self.config.logical_axis_rules
    q = checkpoint_name(self.query(x), "query_proj")
    k = checkpoint_name(self.key(x), "key_proj")
    v = checkpoint_name(self.value(x), "value_proj")
    if self.query_norm is not None:
      q, k = self.query_norm(q), self.key_norm(k)
    c = self.config
    inv_freq, rope_scale = rotary(c, c.head_dim, window)
    rot = dict(interleave=rope.interleaved(c, mla=False), scale=rope_scale)
    q = rope.apply_rope(q, positions, inv_freq, **rot)
    k = rope.apply_rope(k, positions, inv_freq, **rot)
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), rules)
    k = constrain(k, ("activation_batch", "activation_length", "activation_kv_heads", None), rules)
    v = constrain(v, ("activation_batch", "activation_length", "activation_kv_heads", None), rules)
    sinks = self.sinks[...] if self.sinks is not None else None
    if cache is not None:
      ctx, cache = cache.attend(q, k, v, window, self.scale, c.attn_logits_soft_cap, precision(c.matmul_precision), rules, sinks)  # type: ignore[arg-type]
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
      sinks=sinks,
      context=self.context,
    )
    ctx = checkpoint_name(ctx, "context")
    return checkpoint_name(self.out(ctx), "out_proj")
