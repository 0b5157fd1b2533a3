"""The reference attention kernel (`xla`): a materialised [B, K, G, S, T] float32 score tensor, masked by positions,
segment ids and the sliding window, softmaxed with optional sinks (maxtext.layers.attention_ops chooses it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext.layers import matmul

NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(
  q_pos: jax.Array, kv_pos: jax.Array, segment_ids: jax.Array | None, window: int | jax.Array, kv_segment_ids: jax.Array | None = None
) -> jax.Array:
  """Boolean [B, 1, 1, S, T]: causal, same segment, and within the sliding window (window 0 = full).
  kv_segment_ids: the keys' own segment ids when they are not the queries' sequence (default segment_ids)."""
  kv_segments = kv_segment_ids if kv_segment_ids is not None else segment_ids
  return position_mask(q_pos, kv_pos, segment_ids, kv_segments, window)[:, None, None, :, :]


def position_mask(q_pos, kv_pos, q_seg, kv_seg, window) -> jax.Array:
  """Boolean [B, S, T] from positions, optional segment ids and window."""
  allowed = kv_pos[:, None, :] <= q_pos[:, :, None]
  if q_seg is not None:
    allowed &= q_seg[:, :, None] == kv_seg[:, None, :]
  if not (isinstance(window, int) and window == 0):
    allowed &= span_mask(q_pos, kv_pos, window)
  return allowed


def span_mask(q_pos: jax.Array, kv_pos: jax.Array, span: int | jax.Array) -> jax.Array:
  """Boolean [B, S, T]: the keys a layer's span allows beside causality. span > 0: a sliding window, q_pos - kv_pos <
  span; span < 0: chunked local attention (Llama 4), query and key in the same chunk of -span positions; 0: all."""
  if isinstance(span, int) and span == 0:
    return jnp.ones((q_pos.shape[0], q_pos.shape[1], kv_pos.shape[1]), bool)
  span = jnp.asarray(span)
  chunk = jnp.maximum(-span, 1)
  in_window = (q_pos[:, :, None] - kv_pos[:, None, :]) < span
  in_chunk = (q_pos[:, :, None] // chunk) == (kv_pos[:, None, :] // chunk)
  return jnp.where(span > 0, in_window, jnp.where(span < 0, in_chunk, True))


def xla_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  scale: float,
  soft_cap: float | None,
  precision: jax.lax.Precision | None,
  integer_rounding: bool = False,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """q [B,S,H,D], k [B,T,K,D], v [B,T,K,Dv] (H = K*G) -> [B,S,H,Dv]; logits and softmax in float32; sinks [H] or None."""
  b, s, h, d = q.shape
  kv_heads = k.shape[2]
  # Head-major operands ([B, K, G, S, D], [B, K, T, D]) make both einsums plain batched matmuls.
  q = jnp.transpose(q.reshape(b, s, kv_heads, h // kv_heads, d), (0, 2, 3, 1, 4))
  k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  logits = matmul.einsum("bkgsd,bktd->bkgst", q, k, dtype=q.dtype, precision=precision, out_dtype=jnp.float32) * scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  probs = masked_softmax(logits, mask, sinks).astype(v.dtype)
  out = matmul.einsum("bkgst,bktd->bkgsd", probs, v, dtype=v.dtype, precision=precision, integer_rounding=integer_rounding)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, v.shape[-1])


def masked_softmax(logits: jax.Array, mask: jax.Array, sinks: jax.Array | None) -> jax.Array:
  """Softmax over the keys of float32 logits [B, K, G, S, T] where mask allows; sinks [K * G] join each row as one more
  logit whose weight is dropped (so a row sums to less than one)."""
  logits = jnp.where(mask, logits, NEG_INF)
  if sinks is None:
    return jax.nn.softmax(logits, axis=-1)
  _, kv_heads, groups, s, _ = logits.shape
  sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1, 1), (logits.shape[0], kv_heads, groups, s, 1))
  return jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]


def head_major_attention(
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  mask: jax.Array,
  scale: float,
  soft_cap: float | None,
  precision: jax.lax.Precision,
  sinks: jax.Array | None = None,
  key_scale: jax.Array | None = None,
  value_scale: jax.Array | None = None,
) -> jax.Array:
  """q [B, S, H, D] over head-major keys [B, K, T, D] and values [B, K, T, Dv] (H = K * G), mask [B, S, T] -> [B, S, H, Dv].

  The XLA einsum path of xla_attention.xla_attention, with the cache read in its stored layout (no transpose
  of the cache per step); logits and softmax in float32. Quantized keys/values come with their scales
  [B, K or 1, T, 1], applied to the logits and to the softmax weights.
  """
  b, s, h, d = q.shape
  kv_heads = keys.shape[1]
  q = jnp.transpose(q.reshape(b, s, kv_heads, h // kv_heads, d), (0, 2, 3, 1, 4))  # [B, K, G, S, D]
  logits = matmul.einsum("bkgsd,bktd->bkgst", q, keys, dtype=q.dtype, precision=precision, out_dtype=jnp.float32) * scale
  if key_scale is not None:
    logits = logits * per_key(key_scale).astype(jnp.float32)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  probs = masked_softmax(logits, mask[:, None, None], sinks)
  out_dtype = values.dtype
  if value_scale is not None:
    probs, out_dtype = probs * per_key(value_scale).astype(jnp.float32), q.dtype
  out = matmul.einsum("bkgst,bktd->bkgsd", probs.astype(out_dtype), values, dtype=out_dtype, precision=precision)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, values.shape[-1])


def per_key(kv_scale: jax.Array) -> jax.Array:
  """Cache scales [B, K or 1, T, 1] -> [B, K or 1, 1, 1, T], broadcasting over the logits [B, K, G, S, T]."""
  return jnp.swapaxes(kv_scale, 2, 3)[:, :, None]
