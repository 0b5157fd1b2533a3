"""The KV cache: per layer a [batch, kv_heads, slots, head_dim] key and value buffer (MLA: one latent buffer), written as a ring.

Slot `t` of a layer with `T` slots holds the token at position p with p % T == t. A global-attention
layer has T = max_target_length slots (nothing wraps); a sliding-window layer has T = sliding_window_size
slots, a ring buffer that keeps exactly the window. Rows fill positions 0, 1, 2, ... contiguously, so the
position in every slot follows from the row's token count alone (`slot_positions`): the cache stores no
position array, only keys, values and one length per row.

Quantized (quantize_kvcache): keys and values are stored as int8 or int4 q = round(x / s) with a scale
s = absmax / q_max per token, over each head's vector (kv_quant_axis=dkv: scales [B, K, T, 1]) or over all of a
token's heads (heads_and_dkv: [B, 1, T, 1]), in the compute dtype, as buffers 'key_scale' and 'value_scale'. int4
values are stored two per byte along D in uint8 (the stored kernels' packing, maxtext.layers.quantization.pack_int4):
XLA:CPU keeps int4 arrays unpacked and refuses them between executables (prefill -> decode step).
Attention reads them without a dequantized copy: logits = (q . k_int) * s_k per key, and the value scales
multiply the softmax weights before p . v_int.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from maxtext.layers.quantization import pack_int4, unpack_int4
from maxtext.layers.sharding import constrain
from maxtext.layers.xla_attention import head_major_attention, span_mask

CACHE_AXES = ("cache_batch", "cache_heads", "cache_sequence", "cache_kv")  # head-major: attention reads it without a transpose
LATENT_AXES = ("cache_batch", None, "cache_sequence", "cache_kv")  # MLA's latent: one shared "head"
# A Gated DeltaNet layer's decode state: its convolution window [B, K - 1, channels] and recurrent state [B, H_v, d_k, d_v].
STATE_AXES = {"conv": ("cache_batch", None, None), "recurrent": ("cache_batch", "cache_heads", None, None)}
AXES = {
  "key": CACHE_AXES,
  "value": CACHE_AXES,
  "latent": LATENT_AXES,
  "index_key": LATENT_AXES,
  **STATE_AXES,
  **{name: LATENT_AXES for name in ("kv", "entries", "comp_kv", "comp_gate", "index_entries", "index_kv", "index_gate")},  # DeepSeek V4's
}  # index_key: DeepSeek Sparse Attention's indexer keys
KV_QMAX = {"int8": 127.0, "int4": 7.0}
PACKED_INT4 = jnp.dtype(jnp.uint8)  # a cache buffer of this dtype holds int4 values, two per byte along D


def axes(name: str, shape: tuple[int, ...]) -> tuple[str | None, ...]:
  """Logical axes of a cache buffer [B, K, T, D] by name; a scale [B, K or 1, T, 1] is split like its keys except on
  its axes of size 1."""
  if not name.endswith("_scale"):
    return AXES[name]
  return tuple(a if n > 1 else None for a, n in zip(AXES[name.removesuffix("_scale")], shape))


def quantize_kv(x: jax.Array, kv_dtype: Any, per_head: bool) -> tuple[jax.Array, jax.Array]:
  """x [B, K, S, D] -> (round(x / s) in kv_dtype, s [B, K or 1, S, 1] in x's dtype), s = absmax / q_max over D
  (per_head) or over K and D; kv_dtype uint8 (PACKED_INT4): int4 values packed two per byte, [B, K, S, D / 2]."""
  packed = jnp.dtype(kv_dtype) == PACKED_INT4
  kv_dtype = jnp.int4 if packed else kv_dtype
  qmax = KV_QMAX[jnp.dtype(kv_dtype).name]
  absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(3,) if per_head else (1, 3), keepdims=True)
  scale = jnp.where(absmax > 0, absmax / qmax, 1.0).astype(x.dtype)  # the stored scale: x is divided by it, not by its unrounded value
  q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale.astype(jnp.float32)), -qmax, qmax).astype(jnp.int8 if packed else kv_dtype)
  return (pack_int4(q, 3) if packed else q), scale


def unpacked(values: jax.Array) -> jax.Array:
  """A cache buffer's values as attention reads them: packed int4 (uint8) unpacked to int8, others as stored."""
  return unpack_int4(values, 3) if values.dtype == PACKED_INT4 else values


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
  kv_lora_rank latent followed by the rotary key); a quantized cache adds 'key_scale' and 'value_scale'
  [B, K or 1, T, 1]. lengths [B]: tokens already cached per row; new_lengths [B]:
  how many of this call's S input tokens are real (the rest is right padding). The call's tokens sit at
  positions lengths + 0 .. lengths + S - 1. image_ids [B, S] or None: each new token's image (1, 2, ...; 0 for text):
  a prefill's tokens of one image see each other both ways (Gemma 3).
  """

  arrays: dict[str, jax.Array]
  lengths: jax.Array
  new_lengths: jax.Array
  image_ids: jax.Array | None = None

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
    kept = {name: constrain(x, axes(name, x.shape), rules) for name, x in kept.items()}
    causal = kv_pos[:, None, :] <= q_pos[:, :, None]
    if self.image_ids is not None and s > 1:  # the new keys of the query's own image, whatever their position
      ids = self.image_ids
      same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
      causal |= jnp.concatenate([jnp.zeros((*same.shape[:2], kv_pos.shape[1] - s), bool), same], axis=2)
    mask = (kv_pos[:, None, :] >= 0) & causal
    if window:  # a sliding window (> 0) or minus a chunk (< 0): xla_attention.span_mask
      mask &= span_mask(q_pos, kv_pos, window)
    return dataclasses.replace(self, arrays=kept), attended, mask

  def held_positions(self, new: int) -> jax.Array:
    """The position of each entry `update` returned to attend over [B, T'] (-1: empty slot or padding), for S = new
    tokens: a decode step's updated slots, or a prefill's old slots then its new tokens."""
    size = next(iter(self.arrays.values())).shape[2]
    if new == 1:
      return slot_positions(self.lengths + self.new_lengths, size)
    fresh = self.lengths[:, None] + jnp.arange(new, dtype=self.lengths.dtype)
    return jnp.concatenate([slot_positions(self.lengths, size), jnp.where(jnp.arange(new) < self.new_lengths[:, None], fresh, -1)], axis=1)

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
    new = {"key": jnp.swapaxes(k, 1, 2), "value": jnp.swapaxes(v, 1, 2)}  # head-major like the cache
    if "key_scale" in self.arrays:
      scales = self.arrays["key_scale"]
      for name in ("key", "value"):
        new[name], new[f"{name}_scale"] = quantize_kv(new[name].astype(scales.dtype), self.arrays[name].dtype, scales.shape[1] > 1)
    cache, kv, mask = self.update(new, rules, window)
    keys, values = unpacked(kv["key"]), unpacked(kv["value"])
    return head_major_attention(q, keys, values, mask, scale, soft_cap, precision, sinks, kv.get("key_scale"), kv.get("value_scale")), cache
