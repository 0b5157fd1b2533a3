"""The KV cache: per layer a [batch, kv_heads, slots, head_dim] key and value buffer, written as a ring.

Slot `t` of a layer with `T` slots holds the token at position p with p % T == t. A global-attention
layer has T = max_target_length slots (nothing wraps); a sliding-window layer has T = sliding_window_size
slots, a ring buffer that keeps exactly the window. Rows fill positions 0, 1, 2, ... contiguously, so the
position in every slot follows from the row's token count alone (`slot_positions`): the cache stores no
position array, only keys, values and one length per row.

Quantized (quantize_kvcache): keys and values are stored as int8 or int4 q = round(x / s) with a scale
s = absmax / q_max per token, over each head's vector (kv_quant_axis=dkv: scales [B, K, T, 1]) or over all of a
token's heads (heads_and_dkv: [B, 1, T, 1]), in the compute dtype. Attention reads them without a dequantized
copy: logits = (q . k_int) * s_k per key, and the value scales multiply the softmax weights before p . v_int.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from maxtext.layers import attention_ops, matmul
from maxtext.layers.sharding import constrain

CACHE_AXES = ("cache_batch", "cache_heads", "cache_sequence", "cache_kv")  # head-major: attention reads it without a transpose
KV_QMAX = {"int8": 127.0, "int4": 7.0}


def quantize_kv(x: jax.Array, kv_dtype: Any, per_head: bool) -> tuple[jax.Array, jax.Array]:
  """x [B, K, S, D] -> (round(x / s) in kv_dtype, s [B, K or 1, S, 1] in x's dtype), s = absmax / q_max over D
  (per_head) or over K and D."""
  qmax = KV_QMAX[jnp.dtype(kv_dtype).name]
  axes = (3,) if per_head else (1, 3)
  absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / qmax, 1.0)
  q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -qmax, qmax).astype(kv_dtype)
  return q, scale.astype(x.dtype)


def slot_positions(total: jax.Array, size: int) -> jax.Array:
  """Tokens written per row [B] -> absolute position held by each of `size` slots [B, size]; -1 marks an empty slot."""
  last = total[:, None] - 1
  pos = last - jnp.mod(last - jnp.arange(size, dtype=total.dtype), size)
  return jnp.where(pos >= 0, pos, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
  """One attention layer's cache as the layer sees it during a prefill or decode call.

  key/value [B, K, T, D]; lengths [B]: tokens already cached per row; new_lengths [B]: how many of this
  call's S input tokens are real (the rest is right padding). The call's tokens sit at positions
  lengths + 0 .. lengths + S - 1.
  """

  key: jax.Array
  value: jax.Array
  lengths: jax.Array
  new_lengths: jax.Array
  key_scale: jax.Array | None = None  # quantized cache: [B, K or 1, T, 1]
  value_scale: jax.Array | None = None

  @classmethod
  def of(cls, arrays: dict[str, jax.Array], lengths: jax.Array, new_lengths: jax.Array) -> LayerCache:
    """From a layer's cache arrays ({'key', 'value'}, plus {'key_scale', 'value_scale'} when quantized)."""
    return cls(arrays["key"], arrays["value"], lengths, new_lengths, arrays.get("key_scale"), arrays.get("value_scale"))

  def arrays(self) -> dict[str, jax.Array]:
    out = {"key": self.key, "value": self.value}
    if self.key_scale is not None:
      out.update(key_scale=self.key_scale, value_scale=self.value_scale)
    return out

  @property
  def quantized(self) -> bool:
    return self.key_scale is not None

  def attend(
    self,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    window: int,
    scale: float,
    soft_cap: float | None,
    precision: jax.lax.Precision,
    rules,
  ) -> tuple[jax.Array, LayerCache]:
    """Causal (windowed) attention of the new tokens q/k/v [B, S, heads, D] over the cache plus themselves.

    Returns (context [B, S, H, D], updated cache).
    """
    b, s = q.shape[:2]
    size = self.key.shape[2]
    q_pos = self.lengths[:, None] + jnp.arange(s, dtype=self.lengths.dtype)
    total = self.lengths + self.new_lengths
    new = {"key": jnp.swapaxes(k, 1, 2), "value": jnp.swapaxes(v, 1, 2)}  # head-major like the cache: [B, K, S, D]
    if self.quantized:
      for name in ("key", "value"):
        new[name], new[f"{name}_scale"] = quantize_kv(new[name].astype(self.key_scale.dtype), self.key.dtype, self.key_scale.shape[1] > 1)
    else:
      new = {"key": new["key"].astype(self.key.dtype), "value": new["value"].astype(self.value.dtype)}
    old = self.arrays()
    if s == 1:  # decode step: write the token into its slot, then attend over the cache alone
      rows = jnp.arange(b)
      slot = jnp.mod(self.lengths, size)
      stored = {name: old[name].at[rows, :, slot].set(new[name][:, :, 0]) for name in old}
      read, kv_pos = stored, slot_positions(total, size)
    else:  # prefill (or a chunk): attend over old slots + new tokens, then keep the newest `size` positions
      new_pos = jnp.where(jnp.arange(s) < self.new_lengths[:, None], q_pos, -1)
      read = {name: jnp.concatenate([old[name], new[name]], axis=2) for name in old}
      kv_pos = jnp.concatenate([slot_positions(self.lengths, size), new_pos], axis=1)
      index = slot_positions(total, size) - self.lengths[:, None]  # index among the new tokens of the position each slot now holds
      from_new = (index >= 0)[:, None, :, None]
      take = jnp.clip(index, 0, s - 1)[:, None, :, None]
      stored = {name: jnp.where(from_new, jnp.take_along_axis(new[name], take, axis=2), old[name]) for name in old}
    stored["key"], stored["value"] = constrain(stored["key"], CACHE_AXES, rules), constrain(stored["value"], CACHE_AXES, rules)
    mask = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None])
    if window:
      mask &= (q_pos[:, :, None] - kv_pos[:, None, :]) < window
    ctx = head_major_attention(q, read["key"], read["value"], mask, scale, soft_cap, precision, read.get("key_scale"), read.get("value_scale"))
    return ctx, LayerCache.of(stored, self.lengths, self.new_lengths)


def head_major_attention(
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  mask: jax.Array,
  scale: float,
  soft_cap: float | None,
  precision: jax.lax.Precision,
  key_scale: jax.Array | None = None,
  value_scale: jax.Array | None = None,
) -> jax.Array:
  """q [B, S, H, D] over head-major keys/values [B, K, T, D] (H = K * G), mask [B, S, T] -> [B, S, H, D].

  The XLA einsum path of attention_ops.xla_attention, with the cache read in its stored layout (no transpose
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
  logits = jnp.where(mask[:, None, None], logits, attention_ops.NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1)
  if value_scale is not None:
    probs = probs * per_key(value_scale).astype(jnp.float32)
  out_dtype = q.dtype if value_scale is not None else values.dtype
  out = matmul.einsum("bkgst,bktd->bkgsd", probs.astype(out_dtype), values, dtype=out_dtype, precision=precision)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, d)


def per_key(kv_scale: jax.Array) -> jax.Array:
  """Cache scales [B, K or 1, T, 1] -> [B, K or 1, 1, 1, T], broadcasting over the logits [B, K, G, S, T]."""
  return jnp.swapaxes(kv_scale, 2, 3)[:, :, None]
