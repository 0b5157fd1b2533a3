"""The KV cache: per layer a [batch, kv_heads, slots, head_dim] key and value buffer (MLA: one latent buffer), written as a ring.

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

from maxtext.layers import matmul
from maxtext.layers.sharding import constrain
from maxtext.layers.xla_attention import masked_softmax

CACHE_AXES = ("cache_batch", "cache_heads", "cache_sequence", "cache_kv")  # head-major: attention reads it without a transpose
LATENT_AXES = ("cache_batch", None, "cache_sequence", "cache_kv")  # MLA's latent: one shared "head"
AXES = {"key": CACHE_AXES, "value": CACHE_AXES, "latent": LATENT_AXES}


def slot_positions(total: jax.Array, size: int) -> jax.Array:
  """Tokens written per row [B] -> absolute position held by each of `size` slots [B, size]; -1 marks an empty slot."""
  last = total[:, None] - 1
  pos = last - jnp.mod(last - jnp.arange(size, dtype=total.dtype), size)
  return jnp.where(pos >= 0, pos, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
  """One attention layer's cache as the layer sees it during a prefill or decode call.

  arrays: head-major [B, K, T, D] buffers by name: 'key' and 'value' (grouped-query attention, and MLA's naive
  form with per-head keys and values), or 'latent' (MLA's compressed form: K = 1, each slot the normalised
  kv_lora_rank latent followed by the rotary key). lengths [B]: tokens already cached per row; new_lengths [B]:
  how many of this call's S input tokens are real (the rest is right padding). The call's tokens sit at
  positions lengths + 0 .. lengths + S - 1.
  """

  arrays: dict[str, jax.Array]
  lengths: jax.Array
  new_lengths: jax.Array

  def update(self, new: dict[str, jax.Array], rules, window: int = 0) -> tuple[LayerCache, dict[str, jax.Array], jax.Array]:
    """Write this call's entries new[name] [B, K, S, D] into the buffers.

    Returns (updated cache, what the call attends over by name [B, K, T', D], mask [B, S, T'] of the causal,
    non-empty keys within the window). A decode step (S = 1) writes its token into its slot and attends over the
    cache alone; a prefill attends over old slots plus new tokens, then keeps the newest T positions.
    """
    s = next(iter(new.values())).shape[2]
    size = next(iter(self.arrays.values())).shape[2]
    q_pos = self.lengths[:, None] + jnp.arange(s, dtype=self.lengths.dtype)
    total = self.lengths + self.new_lengths
    new = {name: x.astype(self.arrays[name].dtype) for name, x in new.items()}
    if s == 1:
      rows, slot = jnp.arange(q_pos.shape[0]), jnp.mod(self.lengths, size)
      kept = {name: self.arrays[name].at[rows, :, slot].set(x[:, :, 0]) for name, x in new.items()}
      attended, kv_pos = kept, slot_positions(total, size)
    else:
      new_pos = jnp.where(jnp.arange(s) < self.new_lengths[:, None], q_pos, -1)
      attended = {name: jnp.concatenate([self.arrays[name], x], axis=2) for name, x in new.items()}
      kv_pos = jnp.concatenate([slot_positions(self.lengths, size), new_pos], axis=1)
      index = slot_positions(total, size) - self.lengths[:, None]  # index among the new tokens of the position each slot now holds
      from_new = (index >= 0)[:, None, :, None]
      take = jnp.clip(index, 0, s - 1)[:, None, :, None]
      kept = {name: jnp.where(from_new, jnp.take_along_axis(x, take, axis=2), self.arrays[name]) for name, x in new.items()}
    kept = {name: constrain(x, AXES[name], rules) for name, x in kept.items()}
    mask = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None])
    if window:
      mask &= (q_pos[:, :, None] - kv_pos[:, None, :]) < window
    return dataclasses.replace(self, arrays=kept), attended, mask

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
    sinks: jax.Array | None = None,
  ) -> tuple[jax.Array, LayerCache]:
    """Causal (windowed) attention of the new tokens q/k [B, S, heads, D], v [B, S, heads, Dv] over the cache plus themselves.

    Returns (context [B, S, H, Dv], updated cache). sinks [H]: each head's sink logit, or None.
    """
    cache, kv, mask = self.update({"key": jnp.swapaxes(k, 1, 2), "value": jnp.swapaxes(v, 1, 2)}, rules, window)  # head-major like the cache
    return head_major_attention(q, kv["key"], kv["value"], mask, scale, soft_cap, precision, sinks), cache


def head_major_attention(
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  mask: jax.Array,
  scale: float,
  soft_cap: float | None,
  precision: jax.lax.Precision,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """q [B, S, H, D] over head-major keys [B, K, T, D] and values [B, K, T, Dv] (H = K * G), mask [B, S, T] -> [B, S, H, Dv].

  The XLA einsum path of xla_attention.xla_attention, with the cache read in its stored layout (no transpose
  of the cache per step); logits and softmax in float32.
  """
  b, s, h, d = q.shape
  kv_heads = keys.shape[1]
  q = jnp.transpose(q.reshape(b, s, kv_heads, h // kv_heads, d), (0, 2, 3, 1, 4))  # [B, K, G, S, D]
  logits = matmul.einsum("bkgsd,bktd->bkgst", q, keys, dtype=q.dtype, precision=precision, out_dtype=jnp.float32) * scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  probs = masked_softmax(logits, mask[:, None, None], sinks).astype(values.dtype)
  out = matmul.einsum("bkgst,bktd->bkgsd", probs, values, dtype=values.dtype, precision=precision)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, values.shape[-1])
