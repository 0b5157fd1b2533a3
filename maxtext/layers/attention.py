"""Grouped-query self-attention with rotary embeddings, optional QK norm, biases, sinks, soft cap, sliding window or
chunked local attention, partial rotary embedding, a sigmoid output gate, and Llama 4's NoPE layers.

With output_gate (Qwen3-Next's gated attention) the query projection yields per head a query and a gate,
[q | g] = x W_q ([H, 2 D]), and the output is W_o (attend(q, k, v) * sigmoid(g)). With partial_rotary_factor f
the first D f features of each query and key head rotate and the rest pass unrotated.
"""

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
  qk_norm: NormSpec | None = None  # use_qk_norm: RMSNorm on each query and key head (NormSpec.zero_centered: 1 + w)
  qk_norm_per_head: bool = True  # False: qk_norm spans the whole query (key) projection, all heads at once (OLMo 3)
  output_gate: bool = False  # the query projection also yields a per-head gate: out(ctx * sigmoid(gate)) (Qwen3-Next)
  partial_rotary_factor: float = 1.0  # rotate the first head_dim * factor features of q and k, pass the rest
  nope_full_layers: bool = False  # layers of full attention (span 0) neither rotate nor L2-normalise q and k (Llama 4's NoPE)
  l2_qk_norm_eps: float = 0.0  # > 0: a weightless RMS (L2) norm of rotated q and k heads with this epsilon (Llama 4)
  temperature_tuning: tuple[float, float] | None = None  # NoPE layers: q * (1 + scale ln(1 + floor((pos + 1) / floor_scale)))
  value_norm: NormSpec | None = None  # an RMSNorm on each value head (Gemma 4)
  value_norm_scale: bool = True  # the value norm has a learned scale (v_norm_with_scale)
  values_from_keys: bool = False  # no value projection: values are the key projection before its norm and rope (share_kv_projections)
  kv_shared: bool = False  # no key/value projections: the layer attends with keys and values it is given (num_kv_shared_layers)
  window_choices: tuple[int, ...] = ()  # the windows a traced (scanned, per-layer) window can take, sorted
  context: context_parallel.Layout | None = None  # context parallelism's sequence layout (None: none)
  rules: Rules = ()  # logical_axis_rules

  def __post_init__(self):
    if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
      raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1] and rotate an even number of the {self.head_dim} features")

  @property
  def rotary_dim(self) -> int:
    """Features of each head that rotate (Hugging Face's int(head_dim * partial_rotary_factor))."""
    return int(self.head_dim * self.partial_rotary_factor)


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
    self.query = DenseGeneral((e,), (h, 2 * d if spec.output_gate else d), ("embed", "heads", "head_dim"), **kw)  # [q | gate] per head
    self.key = None if spec.kv_shared else DenseGeneral((e,), (kv, d), ("embed", "kv_heads", "head_dim"), **kw)
    self.value = None if spec.kv_shared or spec.values_from_keys else DenseGeneral((e,), (kv, d), ("embed", "kv_heads", "head_dim"), **kw)
    self.out = DenseGeneral((h, d), (e,), ("heads", "head_dim", "embed"), **{**kw, "use_bias": spec.use_bias and spec.out_bias})
    if spec.qk_norm is not None and spec.qk_norm_per_head:
      self.query_norm = RMSNorm.of(d, spec.qk_norm, policy.dtypes, logical_axis="head_dim")
      self.key_norm = RMSNorm.of(d, spec.qk_norm, policy.dtypes, logical_axis="head_dim")
    elif spec.qk_norm is not None:  # one scale over the flattened projection
      self.query_norm = RMSNorm.of(h * d, spec.qk_norm, policy.dtypes, logical_axis="norm")
      self.key_norm = RMSNorm.of(kv * d, spec.qk_norm, policy.dtypes, logical_axis="norm")
    else:
      self.query_norm = self.key_norm = None
    if spec.kv_shared:
      self.key_norm = None
    if spec.value_norm is not None and not spec.kv_shared:
      self.value_norm = RMSNorm.of(d, spec.value_norm, policy.dtypes, logical_axis="head_dim", with_scale=spec.value_norm_scale)
    else:
      self.value_norm = None
    self.sinks = nnx.Param(jnp.zeros((h,), policy.dtypes.params), logical_axes=("heads",)) if spec.sinks else None
    # An explicit kernel that cannot run this model fails here, at build time, as a one-line config error.
    length = spec.max_target_length
    attention_ops.select(policy, dtype=policy.dtypes.compute, head_dim=d, q_len=length, kv_len=length, soft_cap=spec.soft_cap, sinks=spec.sinks)

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    window: int | jax.Array,
    cache: LayerCache | None = None,
    adapter_ids: jax.Array | None = None,
    image_ids: jax.Array | None = None,
    shared_kv: tuple[jax.Array, jax.Array] | None = None,
    return_kv: bool = False,
    rope_positions: jax.Array | None = None,
  ):
    """-> output [B, S, E]; with a KV cache (decoding), -> (output, updated cache). adapter_ids: each row's (or
    token's) LoRA slot, for adapted projections. rope_positions [B, S, 3]: multimodal rope positions (use_mrope), which
    rotate q and k in place of positions (positions still order the mask). shared_kv: the (rotated, normed) keys and values a KV-shared layer
    attends with; return_kv: -> (output, (keys, values)), for the layers that share them. image_ids [B, S]: each
    token's image (0: text), whose tokens see each other both ways (a cache carries its own)."""
    spec = self.spec
    rules = spec.rules
    rotary = positions if rope_positions is None else rope_positions
    q = checkpoint_name(self.query(x, adapter_ids), "query_proj")
    gate = None
    if spec.output_gate:
      q, gate = jnp.split(q, 2, axis=-1)
    if spec.kv_shared:
      if shared_kv is None:
        raise ValueError("a KV-shared attention layer needs the keys and values of its source layer (shared_kv)")
      k, v = shared_kv
      if self.query_norm is not None:
        q = self.query_norm(q)
      q = self._position(q, q, rotary, window)[0]  # keys come rotated from the source layer
    else:
      k = checkpoint_name(self.key(x, adapter_ids), "key_proj")
      v = k if self.value is None else checkpoint_name(self.value(x, adapter_ids), "value_proj")
      if self.query_norm is not None and spec.qk_norm_per_head:
        q, k = self.query_norm(q), self.key_norm(k)
      elif self.query_norm is not None:
        q = self.query_norm(q.reshape(*q.shape[:-2], -1)).reshape(q.shape)
        k = self.key_norm(k.reshape(*k.shape[:-2], -1)).reshape(k.shape)
      if self.value_norm is not None:
        v = self.value_norm(v)
      q, k = self._position(q, k, rotary, window)
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), rules)
    k = constrain(k, ("activation_batch", "activation_length", "activation_kv_heads", None), rules)
    v = constrain(v, ("activation_batch", "activation_length", "activation_kv_heads", None), rules)
    sinks = self.sinks[...] if self.sinks is not None else None
    if cache is not None:
      ctx, cache = cache.attend(q, k, v, window, spec.scale, spec.soft_cap, self.policy.dtypes.precision, rules, sinks)  # type: ignore[arg-type]
      out = self.out(self._gated(ctx, gate), adapter_ids)
      return (out, cache, (k, v)) if return_kv else (out, cache)
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
      image_ids=image_ids,
    )
    ctx = checkpoint_name(ctx, "context")
    out = checkpoint_name(self.out(self._gated(ctx, gate), adapter_ids), "out_proj")
    return (out, (k, v)) if return_kv else out

  def _position(self, q: jax.Array, k: jax.Array, positions: jax.Array, window: int | jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotary embedding (then the L2 norm) of q and k; with nope_full_layers a full-attention layer (window 0, traced
    or not) instead keeps q and k unrotated and temperature-tunes q (Llama 4's NoPE layers)."""
    spec = self.spec
    rq, rk = self._rotate(q, positions, window), self._rotate(k, positions, window)
    if spec.l2_qk_norm_eps > 0:
      rq, rk = l2_norm(rq, spec.l2_qk_norm_eps), l2_norm(rk, spec.l2_qk_norm_eps)
    if not spec.nope_full_layers or (isinstance(window, int) and window != 0):
      return rq, rk
    if spec.temperature_tuning is not None:
      scale, floor_scale = spec.temperature_tuning
      tune = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)) * scale + 1.0
      q = (q * tune[:, :, None, None]).astype(q.dtype)
    if isinstance(window, int):
      return q, k
    nope = jnp.asarray(window) == 0
    return jnp.where(nope, q, rq), jnp.where(nope, k, rk)

  def _rotate(self, x: jax.Array, positions: jax.Array, window: int | jax.Array) -> jax.Array:
    """Rotary embedding of the first rotary_dim features of each head of x [B, S, heads, D]."""
    spec = self.spec
    dim = spec.rotary_dim
    inv_freq, rope_scale = rotary(spec.rope, dim, window)
    rotated = rope.apply_rope(x[..., :dim], positions, inv_freq, interleave=spec.rope.interleave, scale=rope_scale, mrope_section=spec.rope.mrope_section)
    return rotated if dim == spec.head_dim else jnp.concatenate([rotated, x[..., dim:]], axis=-1)

  @staticmethod
  def _gated(ctx: jax.Array, gate: jax.Array | None) -> jax.Array:
    """ctx * sigmoid(gate) (computed in float32), or ctx without a gate."""
    if gate is None:
      return ctx
    return (ctx.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(ctx.dtype)


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) over the last axis, computed in float32, without a scale (Llama 4's query/key norm)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
