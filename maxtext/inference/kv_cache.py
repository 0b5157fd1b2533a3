"""The KV cache: per layer a [batch, slots, kv_heads, head_dim] key and value buffer, written as a ring.

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

from maxtext.layers import attention_ops
from maxtext.layers.sharding import constrain

CACHE_AXES = ("cache_batch", "cache_sequence", "cache_heads", "cache_kv")


def slot_positions(total: jax.Array, size: int) -> jax.Array:
  """Tokens written per row [B] -> absolute position held by each of `size` slots [B, size]; -1 marks an empty slot."""
  last = total[:, None] - 1
  pos = last - jnp.mod(last - jnp.arange(size, dtype=total.dtype), size)
  return jnp.where(pos >= 0, pos, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
  """One attention layer's cache as the layer sees it during a prefill or decode call.

  key/value [B, T, K, D]; lengths [B]: tokens already cached per row; new_lengths [B]: how many of this
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
    """Causal (windowed) attention of the new tokens over the cache plus themselves; returns (context, updated cache)."""
    b, s = q.shape[:2]
    size = self.key.shape[1]
    q_pos = self.lengths[:, None] + jnp.arange(s, dtype=self.lengths.dtype)
    total = self.lengths + self.new_lengths
    if s == 1:  # decode step: write the token into its slot, then attend over the cache alone
      rows = jnp.arange(b)
      slot = jnp.mod(self.lengths, size)
      key = self.key.at[rows, slot].set(k[:, 0].astype(self.key.dtype))
      value = self.value.at[rows, slot].set(v[:, 0].astype(self.value.dtype))
      keys, values, kv_pos = key, value, slot_positions(total, size)
    else:  # prefill (or a chunk): attend over old slots + new tokens, then keep the newest `size` positions
      new_pos = jnp.where(jnp.arange(s) < self.new_lengths[:, None], q_pos, -1)
      keys = jnp.concatenate([self.key, k.astype(self.key.dtype)], axis=1)
      values = jnp.concatenate([self.value, v.astype(self.value.dtype)], axis=1)
      kv_pos = jnp.concatenate([slot_positions(self.lengths, size), new_pos], axis=1)
      held = slot_positions(total, size)
      index = held - self.lengths[:, None]  # index among the new tokens of the position each slot now holds
      from_new = (index >= 0)[:, :, None, None]
      take = jnp.clip(index, 0, s - 1)[:, :, None, None]
      key = jnp.where(from_new, jnp.take_along_axis(k.astype(self.key.dtype), take, axis=1), self.key)
      value = jnp.where(from_new, jnp.take_along_axis(v.astype(self.value.dtype), take, axis=1), self.value)
    key, value = constrain(key, CACHE_AXES, rules), constrain(value, CACHE_AXES, rules)
    mask = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None])
    if window:
      mask &= (q_pos[:, :, None] - kv_pos[:, None, :]) < window
    ctx = attention_ops.xla_attention(q, keys, values, mask[:, None, None], scale, soft_cap, precision)
    return ctx, dataclasses.replace(self, key=key, value=value)
