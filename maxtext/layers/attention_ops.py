"""Dot-product attention kernels: an XLA einsum path and jax.nn.dot_product_attention (cuDNN on GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext.layers import matmul
from maxtext.layers.sharding import target_platform

NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(q_pos: jax.Array, kv_pos: jax.Array, segment_ids: jax.Array | None, window: int | jax.Array) -> jax.Array:
  """Boolean [B, 1, 1, S, T]: causal, same segment, and within the sliding window (window 0 = full)."""
  causal = kv_pos[:, None, :] <= q_pos[:, :, None]  # [B,S,T]
  if segment_ids is not None:
    causal &= segment_ids[:, :, None] == segment_ids[:, None, :]
  if not (isinstance(window, int) and window == 0):
    in_window = (q_pos[:, :, None] - kv_pos[:, None, :]) < window
    causal &= in_window | (jnp.asarray(window) == 0)
  return causal[:, None, None, :, :]


def xla_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  scale: float,
  soft_cap: float | None,
  precision: jax.lax.Precision,
) -> jax.Array:
  """q [B,S,H,D], k [B,T,K,D], v [B,T,K,Dv] (H = K*G) -> [B,S,H,Dv]; logits and softmax in float32."""
  b, s, h, d = q.shape
  kv_heads = k.shape[2]
  # Head-major operands ([B, K, G, S, D], [B, K, T, D]) make both einsums plain batched matmuls.
  q = jnp.transpose(q.reshape(b, s, kv_heads, h // kv_heads, d), (0, 2, 3, 1, 4))
  k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  logits = matmul.einsum("bkgsd,bktd->bkgst", q, k, dtype=q.dtype, precision=precision, out_dtype=jnp.float32) * scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  logits = jnp.where(mask, logits, NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = matmul.einsum("bkgst,bktd->bkgsd", probs, v, dtype=v.dtype, precision=precision)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, v.shape[-1])


def cudnn_supported(q: jax.Array, soft_cap: float | None, segment_ids: jax.Array | None, window: int | jax.Array) -> bool:
  """cuDNN fused attention handles this call: GPU, half precision, no soft cap, static window, no packing."""
  return (
    target_platform() == "gpu"
    and q.dtype in (jnp.bfloat16, jnp.float16)
    and soft_cap is None
    and segment_ids is None
    and isinstance(window, int)
    and q.shape[-1] % 8 == 0
    and q.shape[-1] <= 128
  )


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, window: int) -> jax.Array:
  """Causal attention through jax.nn.dot_product_attention's cuDNN implementation."""
  local = (window - 1, 0) if window else None
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation="cudnn")
