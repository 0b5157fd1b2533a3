"""DeepSeek V4's attention: shared-key-value MQA over a sliding window, plus (in compressed layers) compressed keys.

Every layer (`sliding_attention`, `compressed_sparse_attention`, `heavily_compressed_attention`):

    c     = RMSNorm(x W_qa)                          the query latent (q_lora_rank)
    q_h   = RMS(c W_qb,h)                            per head, no scale; rope on its last rope_dim features
    kv    = RoPE(RMSNorm(x W_kv))                    one head, the key and the value at once
    o_h   = sum_j p_hj kv_j,  p = softmax([q_h . k_j / sqrt(D) ; sink_h]) without the sink's column
    o_h  <- RoPE(o_h) at minus the query's position  (the value's rotation undone on the rope slice)
    y     = concat_g(o_g W_oa,g) W_ob                the grouped low-rank output projection (o_groups, o_lora_rank)

The keys j are the last `window` tokens (i - window < j <= i) and, in the compressed layers, the compressed entries
visible to the query: entry w summarises tokens [w m, (w + 1) m) and is visible from position t when w < (t + 1) // m.

A compressor (rate m) turns each full window of m tokens into one entry: C = x W_c, Z = x W_z + B (B: a learned
position bias per slot), entry = RMSNorm(sum_slots softmax(Z) * C), rotated at position w m (the compress rope).
Heavily compressed attention (HCA, m' = 128) uses non-overlapping windows. Compressed sparse attention (CSA, m = 4)
projects 2 D features per token: the entry of window w softmax-pools window w's second half-features with window w-1's
first half-features (2 m slots, stride m); and a lightning indexer (its own compressor at index_head_dim over the same
windows, queries RoPE(c W_qI), weights x W_w / sqrt(heads)) scores sum_h w_h relu(q_h . K_w) / sqrt(d_I) and keeps
the index_topk visible entries per query. Compressed layers rotate with compress_rope (V4: theta 160000, YaRN);
sliding ones with rope. Rotary pairs are interleaved (x[2i], x[2i+1]) and stay in place.

The whole-sequence form (`__call__`: training) starts at position 0; a window that is not full yet gives no entry.
Decoding (`extend`: a prefill or a decode step over the layer's cache) keeps V4's compressed cache: a ring of the last
`window` keys-and-values, the entries pooled so far, and the projections of the last rate (HCA) or 2 rate (CSA, whose
entry also reads the window before) tokens, from which each window's entry is pooled once its last token arrives;
CSA keeps its indexer's entries and projections the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.layers import matmul
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.rope import RopeSpec, layer_frequencies
from maxtext.layers.xla_attention import NEG_INF
from maxtext.platform import Policy

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")  # HF layer_types


@dataclasses.dataclass(frozen=True)
class CompressedAttentionSpec:
  """One V4 attention layer (maxtext.models.specs builds it)."""

  emb_dim: int
  num_heads: int
  head_dim: int  # D: query, key and value width
  rope_dim: int  # qk_rope_head_dim: the trailing features that rotate
  q_lora_rank: int
  o_groups: int
  o_lora_rank: int
  window: int  # sliding_window_size
  layer_type: str = "sliding_attention"  # one of LAYER_TYPES
  compress_rate: int = 0  # m of this layer's compressor (0: sliding only)
  index_heads: int = 0  # indexer_n_heads (CSA)
  index_head_dim: int = 0  # indexer_head_dim (CSA)
  index_topk: int = 0  # indexer_topk (CSA)
  rope: RopeSpec = RopeSpec()  # the sliding layers' rotary embedding
  compress_rope: RopeSpec = RopeSpec(theta=160_000.0)  # the compressed layers' (their entries and indexer too)
  epsilon: float = 1e-6

  def __post_init__(self):
    if self.layer_type not in LAYER_TYPES:
      raise ValueError(f"unknown DeepSeek V4 layer type {self.layer_type!r}; one of {', '.join(LAYER_TYPES)}")
    if (self.layer_type == "sliding_attention") != (self.compress_rate == 0):
      needed = "of 0" if self.layer_type == "sliding_attention" else "above 0"
      raise ValueError(f"a {self.layer_type} layer needs a compress rate {needed} (got {self.compress_rate})")
    if (self.num_heads * self.head_dim) % self.o_groups:
      raise ValueError(f"o_groups={self.o_groups} does not divide the heads' {self.num_heads * self.head_dim} output features")

  @property
  def overlapping(self) -> bool:
    """CSA: two-window overlapping compression and a lightning indexer."""
    return self.layer_type == "compressed_sparse_attention"


def rotate_interleaved(x: jax.Array, positions: jax.Array, inv_freq, scale: float = 1.0, inverse: bool = False) -> jax.Array:
  """Rotate the trailing 2 len(inv_freq) features of x [B, S, ..., F] in interleaved pairs (x[2i], x[2i+1]), kept in
  place, at positions [B, S]; inverse rotates by minus the angle. In float32, returned in x's dtype."""
  rot = 2 * len(inv_freq)
  angles = positions.astype(jnp.float32)[(...,) + (None,) * (x.ndim - 2)] * jnp.asarray(inv_freq, jnp.float32)
  cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
  if inverse:
    sin = -sin
  x32 = x.astype(jnp.float32)
  pairs = x32[..., x.shape[-1] - rot :].reshape(*x.shape[:-1], rot // 2, 2)
  a, b = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(*x.shape[:-1], rot)
  return jnp.concatenate([x32[..., : x.shape[-1] - rot], rotated], axis=-1).astype(x.dtype)


def _unit_rms(x: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Compressor(nnx.Module):
  """Pools each full window of `rate` tokens into one RMS-normalised, rotated entry of `dim` features (overlapping:
  2 rate slots, the previous window's first half-features and this window's second half-features)."""

  def __init__(self, emb_dim: int, dim: int, rate: int, overlapping: bool, eps: float, *, policy: Policy, rngs: nnx.Rngs):
    self.dim, self.rate, self.overlapping = dim, rate, overlapping
    width = 2 * dim if overlapping else dim
    kw = dense_kwargs(policy, rngs)
    self.wkv = DenseGeneral((emb_dim,), (width,), ("embed", "kv"), **kw)
    self.wgate = DenseGeneral((emb_dim,), (width,), ("embed", "kv"), **kw)
    self.position_bias = nnx.Param(jnp.zeros((rate, width), jnp.float32), logical_axes=(None, "kv"))
    self.norm = RMSNorm(dim, eps, dtype=policy.dtypes.compute, weight_dtype=jnp.float32, logical_axis="kv")

  def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, S, E] -> each token's (kv, gate) [B, S, width], what a decode cache keeps of the windows not pooled yet."""
    return self.wkv(x), self.wgate(x)

  def pool(self, kv: jax.Array, gate: jax.Array, previous: tuple[jax.Array, jax.Array] | None, windows: jax.Array, inv_freq, scale: float) -> jax.Array:
    """The entries of windows [B, n] from their tokens' projections kv, gate [B, n, rate, width] (overlapping: and
    previous, the (kv, gate) of each window before them; window 0 has none) -> [B, n, dim], rotated at w rate."""
    d = self.dim
    bias = self.position_bias[...]
    gate = gate.astype(jnp.float32) + bias
    if self.overlapping:  # slots: window w-1's first half-features (none for w = 0), then window w's second half
      first = (windows == 0)[..., None, None]
      previous_kv = jnp.where(first, jnp.zeros((), kv.dtype), previous[0][..., :d].astype(kv.dtype))
      previous_gate = jnp.where(first, -jnp.inf, previous[1].astype(jnp.float32)[..., :d] + bias[:, :d])
      kv = jnp.concatenate([previous_kv, kv[..., d:]], axis=2)
      gate = jnp.concatenate([previous_gate, gate[..., d:]], axis=2)
    pooled = jnp.sum(kv.astype(jnp.float32) * jax.nn.softmax(gate, axis=2), axis=2).astype(kv.dtype)
    return rotate_interleaved(self.norm(pooled), windows * self.rate, inv_freq, scale)

  def __call__(self, x: jax.Array, inv_freq, scale: float) -> jax.Array:
    """x [B, S, E] -> entries [B, S // rate, dim]."""
    b, s, _ = x.shape
    n, m, d = s // self.rate, self.rate, self.dim
    if n == 0:  # no full window yet
      return jnp.zeros((b, 0, d), x.dtype)
    kv, gate = (y.reshape(b, n, m, -1) for y in self.project(x[:, : n * m]))
    previous = None
    if self.overlapping:
      previous = tuple(jnp.pad(y[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0))) for y in (kv, gate))
    return self.pool(kv, gate, previous, jnp.broadcast_to(jnp.arange(n), (b, n)), inv_freq, scale)


class Indexer(nnx.Module):
  """CSA's lightning indexer over the compressed stream: picks each query's index_topk visible entries."""

  def __init__(self, spec: CompressedAttentionSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    kw = dense_kwargs(policy, rngs)
    self.compressor = Compressor(spec.emb_dim, spec.index_head_dim, spec.compress_rate, True, spec.epsilon, policy=policy, rngs=rngs)
    self.wq_b = DenseGeneral((spec.q_lora_rank,), (spec.index_heads, spec.index_head_dim), ("q_lora", "heads", "head_dim"), **kw)
    self.weights_proj = DenseGeneral((spec.emb_dim,), (spec.index_heads,), ("embed", "heads"), **kw)

  def __call__(self, x: jax.Array, latent: jax.Array, positions: jax.Array, visible: jax.Array, inv_freq, scale: float) -> jax.Array:
    """-> the selected entries [B, S, W] (bool), a subset of visible [B, S, W]."""
    return self.select(x, latent, positions, self.compressor(x, inv_freq, scale), visible, inv_freq, scale)

  def select(self, x: jax.Array, latent: jax.Array, positions: jax.Array, keys: jax.Array, visible: jax.Array, inv_freq, scale: float) -> jax.Array:
    """The index_topk best of the visible [B, S, W] entries by the index keys [B, W, d] -> [B, S, W] (bool)."""
    s = self.spec
    keys = keys.astype(jnp.float32)
    q = rotate_interleaved(self.wq_b(latent), positions, inv_freq, scale).astype(jnp.float32)  # [B, S, h, d]
    hp = jax.lax.Precision.HIGHEST
    scores = jax.nn.relu(jnp.einsum("bshd,bwd->bshw", q, keys, precision=hp)) * s.index_head_dim**-0.5
    weights = self.weights_proj(x).astype(jnp.float32) * s.index_heads**-0.5
    scores = jnp.einsum("bshw,bsh->bsw", scores, weights, precision=hp)
    k = min(s.index_topk, keys.shape[1])
    if k == 0:
      return visible
    _, top = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
    chosen = jnp.any(jax.nn.one_hot(top, keys.shape[1], dtype=bool), axis=-2)
    return chosen & visible


class CompressedAttention(nnx.Module):
  """DeepSeek V4's attention layer (module docstring); called as layer(x [B, S, E], positions [B, S]) -> [B, S, E]."""

  def __init__(self, spec: CompressedAttentionSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    kw = dense_kwargs(policy, rngs)
    h, d, g = spec.num_heads, spec.head_dim, spec.o_groups
    self.wq_a = DenseGeneral((spec.emb_dim,), (spec.q_lora_rank,), ("embed", "q_lora"), **kw)
    self.q_norm = RMSNorm(spec.q_lora_rank, spec.epsilon, dtype=policy.dtypes.compute, weight_dtype=jnp.float32, logical_axis="q_lora")
    self.wq_b = DenseGeneral((spec.q_lora_rank,), (h, d), ("q_lora", "heads", "head_dim"), **kw)
    self.wkv = DenseGeneral((spec.emb_dim,), (d,), ("embed", "head_dim"), **kw)
    self.kv_norm = RMSNorm(d, spec.epsilon, dtype=policy.dtypes.compute, weight_dtype=jnp.float32, logical_axis="head_dim")
    self.wo_a = DenseGeneral((g, h * d // g), (spec.o_lora_rank,), ("heads", "head_dim", "q_lora"), **kw)  # one block per group
    self.wo_b = DenseGeneral((g, spec.o_lora_rank), (spec.emb_dim,), ("heads", "q_lora", "embed"), **kw)
    self.sinks = nnx.Param(jnp.zeros((h,), jnp.float32), logical_axes=("heads",))
    compressed = spec.compress_rate > 0
    self.compressor = Compressor(spec.emb_dim, d, spec.compress_rate, spec.overlapping, spec.epsilon, policy=policy, rngs=rngs) if compressed else None
    self.indexer = Indexer(spec, policy=policy, rngs=rngs) if spec.overlapping else None
    self.dtype = policy.dtypes.compute
    self.precision = policy.dtypes.precision

  def rope(self) -> tuple:
    """(inverse frequencies, cos/sin scale) of this layer's queries, keys and entries."""
    s = self.spec
    return layer_frequencies(s.compress_rope if s.compress_rate else s.rope, s.rope_dim)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    s = self.spec
    inv_freq, scale = self.rope()
    latent = self.q_norm(self.wq_a(x))
    q = rotate_interleaved(_unit_rms(self.wq_b(latent), s.epsilon), positions, inv_freq, scale)  # [B, S, H, D]
    kv = rotate_interleaved(self.kv_norm(self.wkv(x)), positions, inv_freq, scale)  # [B, S, D]
    keys = kv
    mask = (positions[:, :, None] >= positions[:, None, :]) & (positions[:, :, None] - positions[:, None, :] < s.window)
    if self.compressor is not None:
      entries = self.compressor(x, inv_freq, scale)  # [B, W, D]
      visible = jnp.arange(entries.shape[1])[None, None, :] < ((positions + 1) // s.compress_rate)[:, :, None]
      if self.indexer is not None:
        visible = self.indexer(x, latent, positions, visible, inv_freq, scale)
      keys = jnp.concatenate([kv, entries.astype(kv.dtype)], axis=1)
      mask = jnp.concatenate([mask, visible], axis=-1)
    return self._attend(q, keys, mask, positions)

  def _attend(self, q: jax.Array, keys: jax.Array, mask: jax.Array, positions: jax.Array) -> jax.Array:
    """Queries q [B, S, H, D] over the shared keys-and-values keys [B, T, D] where mask [B, S, T] allows, with the
    sinks; the values' rotation undone, then the grouped output projection -> [B, S, E]."""
    s = self.spec
    inv_freq, scale = self.rope()
    logits = matmul.einsum("bshd,btd->bhst", q, keys, dtype=self.dtype, precision=self.precision, out_dtype=jnp.float32) * s.head_dim**-0.5
    logits = jnp.where(mask[:, None], logits, NEG_INF)
    sinks = jnp.broadcast_to(self.sinks[...].astype(jnp.float32)[None, :, None, None], (*logits.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1]
    out = matmul.einsum("bhst,btd->bshd", probs, keys, dtype=self.dtype, precision=self.precision, out_dtype=jnp.float32)
    out = rotate_interleaved(out.astype(self.dtype), positions, inv_freq, scale, inverse=True)
    grouped = out.reshape(*out.shape[:2], s.o_groups, -1)  # [B, S, G, H D / G]
    low = jnp.einsum("bsgi,gir->bsgr", grouped, self.wo_a.kernel[...].astype(self.dtype), precision=self.precision)
    return self.wo_b(low)

  def extend(self, x: jax.Array, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    """x [B, S, E] at positions cache.lengths + 0.. (a prefill or a decode step) over the layer's compressed cache, a
    maxtext.inference.kv_cache.LayerCache (buffers 'kv' [B, 1, window, D]; compressed layers 'comp_kv', 'comp_gate'
    [B, 1, R, width] and 'entries' [B, 1, max_length // rate, D]; CSA also 'index_kv', 'index_gate',
    'index_entries') -> (y [B, S, E], updated cache)."""
    s = self.spec
    inv_freq, scale = self.rope()
    latent = self.q_norm(self.wq_a(x))
    q = rotate_interleaved(_unit_rms(self.wq_b(latent), s.epsilon), positions, inv_freq, scale)
    kv = rotate_interleaved(self.kv_norm(self.wkv(x)), positions, inv_freq, scale)
    arrays = dict(cache.arrays)
    window, attended, mask = dataclasses.replace(cache, arrays={"kv": arrays["kv"]}).update({"kv": kv[:, None]}, (), s.window)
    arrays["kv"], keys = window.arrays["kv"], attended["kv"][:, 0]
    if self.compressor is not None:
      entries = self._pool_new_windows(self.compressor, x, cache, arrays, "comp", "entries", inv_freq, scale)
      visible = jnp.arange(entries.shape[1])[None, None, :] < ((positions + 1) // s.compress_rate)[:, :, None]
      if self.indexer is not None:
        index_keys = self._pool_new_windows(self.indexer.compressor, x, cache, arrays, "index", "index_entries", inv_freq, scale)
        visible = self.indexer.select(x, latent, positions, index_keys, visible, inv_freq, scale)
      keys = jnp.concatenate([keys, entries.astype(keys.dtype)], axis=1)
      mask = jnp.concatenate([mask, visible], axis=-1)
    return self._attend(q, keys, mask, positions), dataclasses.replace(cache, arrays=arrays)

  @staticmethod
  def _pool_new_windows(compressor: Compressor, x: jax.Array, cache: Any, arrays: dict, ring: str, name: str, inv_freq, scale: float) -> jax.Array:
    """Keep the new tokens' projections in the ring arrays[ring + '_kv' / '_gate'], pool every window whose last token
    is among them into arrays[name] [B, 1, W, d] (both updated in place) -> the entries [B, W, d]."""
    b, new = x.shape[:2]
    m = compressor.rate
    kv_name, gate_name = f"{ring}_kv", f"{ring}_gate"
    kv_new, gate_new = compressor.project(x)
    projections = dataclasses.replace(cache, arrays={kv_name: arrays[kv_name], gate_name: arrays[gate_name]})
    kept, attended, _ = projections.update({kv_name: kv_new[:, None], gate_name: gate_new[:, None]}, ())
    arrays.update(kept.arrays)
    held = projections.held_positions(new)
    total = cache.lengths + cache.new_lengths
    windows = cache.lengths[:, None] // m + jnp.arange(new // m + 1, dtype=cache.lengths.dtype)  # [B, K]: the windows that may close now
    closed = ((windows + 1) * m <= total[:, None]) & ((windows + 1) * m > cache.lengths[:, None])

    def gather(first: jax.Array) -> tuple[jax.Array, jax.Array]:  # the tokens of windows starting at first [B, K] -> [B, K, m, width]
      wanted = first[..., None] + jnp.arange(m)
      index = jnp.argmax(held[:, None, None, :] == wanted[..., None], axis=-1).reshape(b, -1, 1)
      return tuple(jnp.take_along_axis(attended[k][:, 0], index, axis=1).reshape(*wanted.shape, -1) for k in (kv_name, gate_name))

    kv, gate = gather(windows * m)
    previous = gather((windows - 1) * m) if compressor.overlapping else None
    pooled = compressor.pool(kv, gate, previous, windows, inv_freq, scale)  # [B, K, d]
    stored = arrays[name][:, 0]
    hit = (jnp.arange(stored.shape[1])[None, None, :] == windows[..., None]) & closed[..., None]  # [B, K, W]
    chosen = jnp.take_along_axis(pooled, jnp.argmax(hit, axis=1)[..., None], axis=1)
    stored = jnp.where(jnp.any(hit, axis=1)[..., None], chosen.astype(stored.dtype), stored)
    arrays[name] = stored[:, None]
    return stored
