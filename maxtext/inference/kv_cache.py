"""The KV cache: per layer a [batch, kv_heads, slots, head_dim] key and value buffer, written as a ring.

Slot `t` of a layer with `T` slots holds the token at position p with p % T == t. A global-attention
layer has T = max_target_length slots (nothing wraps); a sliding-window layer has T = sliding_window_size
slots, a ring buffer that keeps exactly the window. Rows fill positions 0, 1, 2, ... contiguously, so the
position in every slot follows from the row's token count alone (`slot_positions`): the cache stores no
position array, only keys, values and one length per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from maxtext.layers import attention_ops, matmul
from maxtext.layers.sharding import constrain

CACHE_AXES = ("cache_batch", "cache_heads", "cache_sequence", "cache_kv")  # head-major: attention reads it without a transpose


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
    k = jnp.swapaxes(k, 1, 2).astype(self.key.dtype)  # head-major like the cache: [B, K, S, D]
    v = jnp.swapaxes(v, 1, 2).astype(self.value.dtype)
    if s == 1:  # decode step: write the token into its slot, then attend over the cache alone
      rows = jnp.arange(b)
      slot = jnp.mod(self.lengths, size)
      key = self.key.at[rows, :, slot].set(k[:, :, 0])
      value = self.value.at[rows, :, slot].set(v[:, :, 0])
      keys, values, kv_pos = key, value, slot_positions(total, size)
    else:  # prefill (or a chunk): attend over old slots + new tokens, then keep the newest `size` positions
      new_pos = jnp.where(jnp.arange(s) < self.new_lengths[:, None], q_pos, -1)
      keys = jnp.concatenate([self.key, k], axis=2)
      values = jnp.concatenate([self.value, v], axis=2)
      kv_pos = jnp.concatenate([slot_positions(self.lengths, size), new_pos], axis=1)
      index = slot_positions(total, size) - self.lengths[:, None]  # index among the new tokens of the position each slot now holds
      from_new = (index >= 0)[:, None, :, None]
      take = jnp.clip(index, 0, s - 1)[:, None, :, None]
      key = jnp.where(from_new, jnp.take_along_axis(k, take, axis=2), self.key)
      value = jnp.where(from_new, jnp.take_along_axis(v, take, axis=2), self.value)
    key, value = constrain(key, CACHE_AXES, rules), constrain(value, CACHE_AXES, rules)
    mask = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None])
    if window:
      mask &= (q_pos[:, :, None] - kv_pos[:, None, :]) < window
    ctx = head_major_attention(q, keys, values, mask, scale, soft_cap, precision)
    return ctx, dataclasses.replace(self, key=key, value=value)


def head_major_attention(
  q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, scale: float, soft_cap: float | None, precision: jax.lax.Precision
) -> jax.Array:
  """q [B, S, H, D] over head-major keys/values [B, K, T, D] (H = K * G), mask [B, S, T] -> [B, S, H, D].

  The XLA einsum path of attention_ops.xla_attention, with the cache read in its stored layout (no transpose
  of the cache per step); logits and softmax in float32.
  """
  b, s, h, d = q.shape
  kv_heads = keys.shape[1]
  q = jnp.transpose(q.reshape(b, s, kv_heads, h // kv_heads, d), (0, 2, 3, 1, 4))  # [B, K, G, S, D]
  logits = matmul.einsum("bkgsd,bktd->bkgst", q, keys, dtype=q.dtype, precision=precision, out_dtype=jnp.float32) * scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  logits = jnp.where(mask[:, None, None], logits, attention_ops.NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
  out = matmul.einsum("bkgst,bktd->bkgsd", probs, values, dtype=values.dtype, precision=precision)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, d)
