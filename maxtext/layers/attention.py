"""Grouped-query self-attention with rotary embeddings, optional QK norm, biases, sinks, soft cap and sliding window."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.layers import attention_ops, context_parallel, rope
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import NormSpec, RMSNorm
from maxtext.layers.sharding import Rules, constrain
from maxtext.platform import Policy

if TYPE_CHECKING:
  from maxtext.layers.attention_ops import LayerCache


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Grouped-query self-attention (maxtext.models.specs builds it)."""

  emb_dim: int
  num_query_heads: int
  num_kv_heads: int
  head_dim: int
  rope: rope.RopeSpec
  scale: float  # the softmax scale: query_pre_attn_scalar (or head_dim) ** -0.5
  max_target_length: int  # the longest sequence, for the kernel check at build time
  soft_cap: float | None = None  # attn_logits_soft_cap: cap * tanh(logits / cap) (None or 0: off)
  use_bias: bool = False  # attention_bias: q/k/v biases, and o's with out_bias
  out_bias: bool = True  # with use_bias, the output projection has a bias too (Qwen2's has none)
  sinks: bool = False  # attention_sink: a learned sink logit per query head
  qk_norm: NormSpec | None = None  # use_qk_norm: RMSNorm on each query and key head
  qk_norm_per_head: bool = True  # False: qk_norm spans the whole query (key) projection, all heads at once (OLMo 3)
  window_choices: tuple[int, ...] = ()  # the windows a traced (scanned, per-layer) window can take, sorted
  context: context_parallel.Layout | None = None  # context parallelism's sequence layout (None: none)
  rules: Rules = ()  # logical_axis_rules


def rotary(spec: rope.RopeSpec, dim: int, window: int | jax.Array) -> tuple[jax.Array, float | jax.Array]:
  """(inverse frequencies, cos/sin scale) of a layer with this window: local (sliding-window) layers may rotate with
  their own base (RopeSpec.local_theta); a traced window picks between the two sets per layer."""
  inv_global, scale = rope.layer_frequencies(spec, dim, local=False)
  if spec.local_theta <= 0:
    return jnp.asarray(inv_global, jnp.float32), scale
  inv_local, local_scale = rope.layer_frequencies(spec, dim, local=True)
  if isinstance(window, int):
    return jnp.asarray(inv_local if window else inv_global, jnp.float32), local_scale if window else scale
  local_layer = jnp.asarray(window) > 0
  inv = jnp.where(local_layer, jnp.asarray(inv_local, jnp.float32), jnp.asarray(inv_global, jnp.float32))
  return inv, scale if scale == local_scale else jnp.where(local_layer, jnp.float32(local_scale), jnp.float32(scale))


class Attention(nnx.Module):
  """Self-attention; the kernel comes from policy (maxtext.platform)."""

  def __init__(self, spec: AttentionSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.policy = policy
    e, h, kv, d = spec.emb_dim, spec.num_query_heads, spec.num_kv_heads, spec.head_dim
    kw = dict(dense_kwargs(policy, rngs), use_bias=spec.use_bias)
    self.query = DenseGeneral((e,), (h, d), ("embed", "heads", "head_dim"), **kw)
    self.key = DenseGeneral((e,), (kv, d), ("embed", "kv_heads", "head_dim"), **kw)
    self.value = DenseGeneral((e,), (kv, d), ("embed", "kv_heads", "head_dim"), **kw)
    self.out = DenseGeneral((h, d), (e,), ("heads", "head_dim", "embed"), **{**kw, "use_bias": spec.use_bias and spec.out_bias})
    if spec.qk_norm is not None and spec.qk_norm_per_head:
      self.query_norm = RMSNorm.of(d, spec.qk_norm, policy.dtypes, logical_axis="head_dim")
      self.key_norm = RMSNorm.of(d, spec.qk_norm, policy.dtypes, logical_axis="head_dim")
    elif spec.qk_norm is not None:  # one scale over the flattened projection
      self.query_norm = RMSNorm.of(h * d, spec.qk_norm, policy.dtypes, logical_axis="norm")
      self.key_norm = RMSNorm.of(kv * d, spec.qk_norm, policy.dtypes, logical_axis="norm")
    else:
      self.query_norm = self.key_norm = None
    self.sinks = nnx.Param(jnp.zeros((h,), policy.dtypes.params), logical_axes=("heads",)) if spec.sinks else None
    # An explicit kernel that cannot run this model fails here, at build time, as a one-line config error.
    length = spec.max_target_length
    attention_ops.select(policy, dtype=policy.dtypes.compute, head_dim=d, q_len=length, kv_len=length, soft_cap=spec.soft_cap, sinks=spec.sinks)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, window: int | jax.Array, cache: LayerCache | None = None):
    """-> output [B, S, E]; with a KV cache (decoding), -> (output, updated cache)."""
    spec = self.spec
    rules = spec.rules
    q = checkpoint_name(self.query(x), "query_proj")
    k = checkpoint_name(self.key(x), "key_proj")
    v = checkpoint_name(self.value(x), "value_proj")
    if self.query_norm is not None and spec.qk_norm_per_head:
      q, k = self.query_norm(q), self.key_norm(k)
    elif self.query_norm is not None:
      q = self.query_norm(q.reshape(*q.shape[:-2], -1)).reshape(q.shape)
      k = self.key_norm(k.reshape(*k.shape[:-2], -1)).reshape(k.shape)
    inv_freq, rope_scale = rotary(spec.rope, spec.head_dim, window)
    rot = dict(interleave=spec.rope.interleave, scale=rope_scale)
    q = rope.apply_rope(q, positions, inv_freq, **rot)
    k = rope.apply_rope(k, positions, inv_freq, **rot)
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), rules)
    k = constrain(k, ("activation_batch", "activation_length", "activation_kv_heads", None), rules)
    v = constrain(v, ("activation_batch", "activation_length", "activation_kv_heads", None), rules)
    sinks = self.sinks[...] if self.sinks is not None else None
    if cache is not None:
      ctx, cache = cache.attend(q, k, v, window, spec.scale, spec.soft_cap, self.policy.dtypes.precision, rules, sinks)  # type: ignore[arg-type]
      return self.out(ctx), cache
    ctx = attention_ops.attend(
      q,
      k,
      v,
      q_positions=positions,
      kv_positions=positions,
      segment_ids=segment_ids,
      window=window,
      soft_cap=spec.soft_cap,
      scale=spec.scale,
      policy=self.policy,
      precision=self.policy.dtypes.precision,
      window_choices=spec.window_choices,
      rules=rules,
      sinks=sinks,
      context=spec.context,
    )
    ctx = checkpoint_name(ctx, "context")
    return checkpoint_name(self.out(ctx), "out_proj")
