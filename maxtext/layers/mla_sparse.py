"""DeepSeek Sparse Attention (DeepSeek V3.2): multi-head latent attention over the top-k keys a lightning indexer picks.

The indexer scores every (query t, key s) pair cheaply:

    I(t, s) = sum_j w_j(t) relu(q_j(t) . k(s) / sqrt(d)),   w(t) = x_t W_w / sqrt(heads)

with its own queries q_j = RoPE(W_qb c_t) from MLA's normalised query latent c_t, one shared key k = RoPE(LayerNorm(x_s
W_k)) (rotary on the first qk_rope_head_dim features, split halves), and per-head weights w. Each query attends only
to the index_topk allowed keys (causal, same segment, in the window) of highest score; with fewer allowed keys it
attends to all of them. Decoding caches the indexer keys beside MLA's cache and selects over the whole cache.

Training signal (the DeepSeek V3.2 report): the indexer's distribution softmax(I(t, .)) is pulled towards the main
attention's, p(t, .) = L1-normalised sum over heads of the attention probabilities (detached), by
KL(p || softmax(I)) per query token. In the dense warm-up the main attention stays dense and the KL covers every
allowed key; in sparse training both distributions are restricted to the selected keys. The indexer reads detached
inputs, so the KL trains only the indexer and the language-model loss (which the discrete selection cannot carry
back) only the rest of the model.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.errors import ConfigError
from maxtext.layers import attention_ops, context_parallel, matmul, rope
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.mla import MLA, MLASpec
from maxtext.layers.sharding import constrain
from maxtext.layers.xla_attention import NEG_INF, head_major_attention, position_mask, xla_attention
from maxtext.platform import Policy

if TYPE_CHECKING:
  from maxtext.layers.attention_ops import LayerCache

INDEX_KEY = "index_key"  # the decode cache's buffer of indexer keys [B, 1, T, indexer_head_dim]


@dataclasses.dataclass(frozen=True)
class IndexerSpec:
  """The lightning indexer (maxtext.models.specs builds it from MaxText's indexer_* keys)."""

  num_heads: int  # indexer_n_heads
  head_dim: int  # indexer_head_dim (its first qk_rope_head_dim features rotate)
  topk: int  # indexer_topk: keys each query attends to
  loss_scale: float = 0.0  # indexer_loss_scaling_factor: weight of the KL term (0: none computed)
  dense_warmup: bool = False  # the main attention stays dense and the KL covers every allowed key (indexer_sparse_training=false)
  norm_epsilon: float = 1e-6  # the key LayerNorm's epsilon (DeepSeek's)


@dataclasses.dataclass(frozen=True)
class SparseMLASpec:
  """MLA with the lightning indexer (DeepSeek Sparse Attention)."""

  mla: MLASpec
  indexer: IndexerSpec


QUERY_BLOCK = 128  # queries per step of the training path: its index scores are [B, 128, T] and no [S, T] array is live


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryBlocks:
  """The per-query arrays of a sparse attention call, [B, S, ...] (or one block of them, [B, Bq, ...]); None: unused."""

  positions: jax.Array
  segment_ids: jax.Array | None
  real: jax.Array  # [B, S] the query tokens the KL counts (not padding)
  index_queries: jax.Array  # the indexer's queries [B, S, heads, head_dim]
  index_weights: jax.Array  # the indexer's head weights [B, S, heads]
  q: jax.Array | None = None  # the main queries [B, S, H, nope + rope] (masked form and warm-up)
  q_nope: jax.Array | None = None  # the gather form's query parts [B, S, H, nope], [B, S, H, rope]
  q_rope: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class KeySide:
  """What every query block reads of the keys: positions, segment ids [B, T], the indexer keys [B, T, D], the window."""

  positions: jax.Array
  segment_ids: jax.Array | None
  index_keys: jax.Array
  window: int | jax.Array


def map_query_blocks(fn, queries: QueryBlocks, block: int, shards: int = 1) -> tuple[jax.Array | None, jax.Array]:
  """fn(one block of queries) -> (per-query output [B, Bq, ...] or None, a float32 scalar), run block by block (a
  scan with a rematerialised body: the backward pass too holds one block's intermediates) -> (the outputs [B, S, ...],
  the scalars' sum). Each shard's last block is padded with segment id 0, position 0 and real=False queries, cut
  afterwards.

  shards > 1 (context parallelism: the sequence split in `shards` equal pieces along the mesh's `context` axis): step j
  takes block j of every shard, so a step's queries [B, shards x block] stay split over `context` like the sequence
  and each device scans only its own queries (the keys each block reads are the whole sequence's)."""
  s = queries.real.shape[1]
  per_shard = s // shards
  block = min(block, per_shard)
  if block == s:
    return fn(queries)
  n = -(-per_shard // block)
  pad = n * block - per_shard

  def split(x: jax.Array) -> jax.Array:  # [B, S, ...] -> [n, B, shards x block, ...]
    x = x.reshape(x.shape[0], shards, per_shard, *x.shape[2:])
    x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    x = jnp.moveaxis(x.reshape(x.shape[0], shards, n, block, *x.shape[3:]), 2, 0)
    return x.reshape(n, x.shape[1], shards * block, *x.shape[4:])

  body = jax.checkpoint(fn, prevent_cse=False)

  def step(total: jax.Array, blk: QueryBlocks):
    out, part = body(blk)
    return total + part, out

  total, outs = jax.lax.scan(step, jnp.zeros((), jnp.float32), jax.tree.map(split, queries))
  if outs is None:
    return None, total
  outs = jnp.moveaxis(outs.reshape(n, outs.shape[1], shards, block, *outs.shape[3:]), 0, 2)  # [B, shards, n, block, ...]
  return outs.reshape(outs.shape[0], shards, n * block, *outs.shape[4:])[:, :, :per_shard].reshape(outs.shape[0], s, *outs.shape[4:]), total


class LayerNorm(nnx.Module):
  """(x - mean) / std * scale + bias over the last axis, in float32 (the indexer's key norm)."""

  def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, weight_dtype: jnp.dtype):
    self.eps, self.dtype = eps, dtype
    self.scale = nnx.Param(jnp.ones((dim,), weight_dtype), logical_axes=("norm",))
    self.bias = nnx.Param(jnp.zeros((dim,), weight_dtype), logical_axes=("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


class Indexer(nnx.Module):
  """The lightning indexer's projections: wq_b (query latent -> heads x head_dim), wk (input -> one shared key),
  k_norm, weights_proj (input -> one weight per head, float32)."""

  def __init__(self, spec: IndexerSpec, mla: MLASpec, *, policy: Policy, rngs: nnx.Rngs):
    if mla.q_lora_rank == 0:
      raise ConfigError("DeepSeek Sparse Attention's indexer projects MLA's query latent; set q_lora_rank > 0")
    if spec.head_dim < mla.qk_rope_head_dim:
      raise ConfigError(f"indexer_head_dim={spec.head_dim} is smaller than its rotary part qk_rope_head_dim={mla.qk_rope_head_dim}; raise it")
    self.spec, self.mla = spec, mla
    kw = dense_kwargs(policy, rngs)
    self.wq_b = DenseGeneral((mla.q_lora_rank,), (spec.num_heads, spec.head_dim), ("q_lora", "heads", "head_dim"), **kw)
    self.wk = DenseGeneral((mla.emb_dim,), (spec.head_dim,), ("embed", "head_dim"), **kw)
    self.k_norm = LayerNorm(spec.head_dim, spec.norm_epsilon, dtype=policy.dtypes.compute, weight_dtype=policy.dtypes.params)
    self.weights_proj = DenseGeneral((mla.emb_dim,), (spec.num_heads,), ("embed", "heads"), **{**kw, "dtype": jnp.float32, "quant": None})

  def _rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary embedding on the first qk_rope_head_dim features (split halves, MLA's frequencies and cos/sin scale)."""
    d = self.mla.qk_rope_head_dim
    inv_freq, scale = rope.layer_frequencies(self.mla.rope, d)
    return jnp.concatenate([rope.apply_rope(x[..., :d], positions, inv_freq, interleave=False, scale=scale), x[..., d:]], axis=-1)

  def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, S, E] (detached) -> the indexer keys [B, S, head_dim]."""
    k = self.k_norm(self.wk(x))
    return self._rotate(k[:, :, None, :], positions)[:, :, 0, :]

  def queries(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> (queries [B, S, heads, head_dim], head weights [B, S, heads] float32 with 1/sqrt(heads))."""
    q = self._rotate(self.wq_b(q_latent), positions)
    w = self.weights_proj(x.astype(jnp.float32)).astype(jnp.float32) * self.spec.num_heads**-0.5
    return q, w

  def scores(self, q: jax.Array, w: jax.Array, k: jax.Array) -> jax.Array:
    """Index scores I [B, S, T] float32 of queries q [B, S, H, D] (weights w [B, S, H]) against keys k [B, T, D].

    A scan over the heads adds one head's w_j relu(q_j . k / sqrt(d)) at a time (its body rematerialised), so neither
    pass holds the [B, S, T, H] per-head scores (4 GiB per row at 4096 tokens and 64 heads)."""
    k = k.astype(jnp.float32)
    q = q.astype(jnp.float32) * self.spec.head_dim**-0.5

    def add_head(total, head):
      qh, wh = head  # [B, S, D], [B, S]
      return total + jax.nn.relu(jnp.einsum("bsd,btd->bst", qh, k)) * wh[..., None], None

    zero = jnp.zeros(q.shape[:2] + k.shape[1:2], jnp.float32)
    total, _ = jax.lax.scan(jax.checkpoint(add_head), zero, (jnp.moveaxis(q, 2, 0), jnp.moveaxis(w, 2, 0)))
    return total


def select_topk(scores: jax.Array, allowed: jax.Array, k: int) -> jax.Array:
  """Boolean [B, S, T]: the (at most) k allowed keys of highest score per query, ties broken towards earlier keys."""
  k = min(k, scores.shape[-1])
  scores = jnp.where(allowed, scores, -jnp.inf)
  kth = jax.lax.top_k(scores, k)[0][..., -1:]
  greater = scores > kth
  equal = scores == kth
  room = k - jnp.sum(greater, axis=-1, keepdims=True)
  return (greater | (equal & (jnp.cumsum(equal, axis=-1) <= room))) & allowed


def indexer_kl(index_scores: jax.Array, attention_probs: jax.Array, support: jax.Array, real: jax.Array) -> jax.Array:
  """Sum over real query tokens of KL(p || softmax(I)) on the support keys.

  index_scores [B, S, T]; attention_probs [B, H, S, T] (each head's main attention probabilities); support [B, S, T]
  the keys both distributions cover; real [B, S] the query tokens counted. p is the heads' sum restricted to the
  support, L1-normalised."""
  p = jnp.sum(jnp.where(support[:, None], attention_probs, 0.0), axis=1)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  log_q = jax.nn.log_softmax(jnp.where(support, index_scores, NEG_INF), axis=-1)
  kl = jnp.sum(jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0), axis=-1)
  return jnp.sum(jnp.where(real, kl, 0.0))


class SparseMLA(MLA):
  """MLA whose queries attend only to the indexer's top-k keys. Called without a cache it returns (output, the layer's
  summed KL term times indexer_loss_scaling_factor); with a cache, (output, updated cache)."""

  def __init__(self, spec: SparseMLASpec, *, policy: Policy, rngs: nnx.Rngs):
    super().__init__(spec.mla, policy=policy, rngs=rngs)
    self.sparse = spec
    self.indexer = Indexer(spec.indexer, spec.mla, policy=policy, rngs=rngs)

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    window: int | jax.Array,
    cache: LayerCache | None = None,
    adapter_ids: jax.Array | None = None,
  ):
    spec, ix = self.spec, self.sparse.indexer
    nope, rope_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim
    q, q_latent = self.queries(x, adapter_ids)
    kv_a = checkpoint_name(self.wkv_a(x, adapter_ids), "kv_wa_proj")
    latent, k_rope = self.kv_norm(kv_a[..., : spec.kv_lora_rank]), kv_a[..., spec.kv_lora_rank :]
    inv_freq, rope_scale = rope.layer_frequencies(spec.rope, rope_dim)
    rot = dict(interleave=spec.rope.interleave, scale=rope_scale)
    q_rope = rope.apply_rope(q[..., nope:], positions, inv_freq, **rot)
    k_rope = rope.apply_rope(k_rope[:, :, None, :], positions, inv_freq, **rot)
    # The indexer reads detached inputs: the language-model loss never reaches it, its KL reaches nothing else.
    x_ix, latent_ix = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
    iq, iw = self.indexer.queries(x_ix, latent_ix, positions)
    ik = self.indexer.keys(x_ix, positions)
    if cache is not None:
      return self._decode(q[..., :nope], q_rope, latent, k_rope, iq, iw, ik, window, cache, adapter_ids)
    real = segment_ids != 0 if segment_ids is not None else jnp.ones(positions.shape, bool)
    queries = QueryBlocks(positions=positions, segment_ids=segment_ids, real=real, index_queries=iq, index_weights=iw)
    keys = KeySide(positions=positions, segment_ids=segment_ids, index_keys=ik, window=window)
    shards = self._context_shards(x.shape[1])
    whole = self._whole if shards > 1 else (lambda a: a)  # the key side of every query block: the whole sequence
    keys = dataclasses.replace(keys, **{f: whole(getattr(keys, f)) for f in ("positions", "segment_ids", "index_keys")})
    if self.policy.sparse_attention == "gather" and not ix.dense_warmup and self.wkv_b.lora is None:
      # The absorbed form: no per-head keys or values at all, only the latent and the shared rotary key.
      slots = jnp.concatenate([latent, k_rope[:, :, 0, :].astype(latent.dtype)], axis=-1)
      ctx, kl = self._gathered(dataclasses.replace(queries, q_nope=q[..., :nope], q_rope=q_rope), keys, whole(slots), shards)
    else:
      kv = checkpoint_name(self.wkv_b(latent, adapter_ids), "key_proj")
      k_nope, v = kv[..., :nope], kv[..., nope:]
      q = jnp.concatenate([q[..., :nope], q_rope], axis=-1)
      k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:-1] + (rope_dim,))], axis=-1)
      rules = spec.rules
      q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), rules)
      k = constrain(k, ("activation_batch", "activation_length", "activation_heads", None), rules)
      v = constrain(v, ("activation_batch", "activation_length", "activation_heads", None), rules)
      if ix.dense_warmup:  # dense MLA (the platform's attention kernel); the KL over every allowed key, per query block
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
          rules=rules,
        )
        kl = self._warmup_kl(dataclasses.replace(queries, q=jax.lax.stop_gradient(q)), keys, whole(jax.lax.stop_gradient(k)), shards) if ix.loss_scale else None
      else:
        ctx, kl = self._masked(dataclasses.replace(queries, q=q), keys, whole(k), whole(v), shards)
    out = checkpoint_name(self.out(checkpoint_name(ctx, "context"), adapter_ids), "out_proj")
    if ix.loss_scale == 0:
      return out, jnp.zeros((), jnp.float32)
    return out, ix.loss_scale * kl

  def _context_shards(self, length: int) -> int:
    """The context shards the query blocks follow (map_query_blocks): 1 without context parallelism."""
    layout = self.spec.context
    return layout.shards if context_parallel.is_active(layout, length, length) else 1

  def _whole(self, x: jax.Array | None) -> jax.Array | None:
    """A key-side array [B, T, ...] whole along the sequence on every context shard (gathered once per layer), in
    natural order under the load balance, so that top-k ties go to the earlier key as without context parallelism."""
    if x is None:
      return None
    x = constrain(x, ("activation_batch",) + (None,) * (x.ndim - 1), self.spec.rules)
    return self.spec.context.restore(x)

  def _select(self, blk: QueryBlocks, keys: KeySide) -> tuple[jax.Array, jax.Array]:
    """One query block's (index scores [B, Bq, T], allowed keys [B, Bq, T])."""
    allowed = position_mask(blk.positions, keys.positions, blk.segment_ids, keys.segment_ids, keys.window)
    return self.indexer.scores(blk.index_queries, blk.index_weights, keys.index_keys), allowed

  def _masked(self, queries: QueryBlocks, keys: KeySide, k: jax.Array, v: jax.Array, shards: int) -> tuple[jax.Array, jax.Array]:
    """Per query block: XLA attention over every key, masked to the top-k (the dense masked form, one block at a time)."""
    spec, ix, prec = self.spec, self.sparse.indexer, self.policy.dtypes.precision

    def block(blk: QueryBlocks) -> tuple[jax.Array, jax.Array]:
      scores, allowed = self._select(blk, keys)
      mask = jax.lax.stop_gradient(select_topk(scores, allowed, ix.topk))
      ctx = xla_attention(blk.q, k, v, mask[:, None, None], spec.scale, spec.soft_cap, prec, self.policy.integer_bf16_rounding)
      if ix.loss_scale == 0:
        return ctx, jnp.zeros((), jnp.float32)
      probs = self._attention_probs(jax.lax.stop_gradient(blk.q), jax.lax.stop_gradient(k), mask)
      return ctx, indexer_kl(scores, probs, mask, blk.real)

    return map_query_blocks(block, queries, QUERY_BLOCK, shards)

  def _warmup_kl(self, queries: QueryBlocks, keys: KeySide, k: jax.Array, shards: int) -> jax.Array:
    """The dense warm-up's KL over every allowed key, per query block (queries and keys detached)."""

    def block(blk: QueryBlocks) -> tuple[None, jax.Array]:
      scores, allowed = self._select(blk, keys)
      return None, indexer_kl(scores, self._attention_probs(blk.q, k, allowed), allowed, blk.real)

    return map_query_blocks(block, queries, QUERY_BLOCK, shards)[1]

  def _gathered(self, queries: QueryBlocks, keys: KeySide, slots: jax.Array, shards: int) -> tuple[jax.Array, jax.Array]:
    """Per query block: gather each query's top-k latent slots [latent | rotary key] (slots [B, T, R + rope]) and
    attend in the latent space (the absorbed form of the module docstring of maxtext.layers.mla)."""
    spec, ix = self.spec, self.sparse.indexer
    prec, dt = self.policy.dtypes.precision, self.policy.dtypes.compute
    nope, rank = spec.qk_nope_head_dim, spec.kv_lora_rank
    kernel = self.wkv_b.kernel[...]  # [R, H, nope + v]
    slots = slots.astype(dt)
    topk = min(ix.topk, slots.shape[1])

    def block(blk: QueryBlocks) -> tuple[jax.Array, jax.Array]:
      scores, allowed = self._select(blk, keys)
      best, picked = jax.lax.top_k(jax.lax.stop_gradient(jnp.where(allowed, scores, -jnp.inf)), topk)  # ties: the earlier key
      valid = best > -jnp.inf  # fewer allowed keys than k: the rest are padding
      gathered = jax.vmap(lambda s, i: s[i])(slots, picked)  # [B, Bq, k, R + rope]
      q_lat = matmul.einsum("bshn,rhn->bshr", blk.q_nope, kernel[..., :nope], dtype=dt, precision=prec)
      query = jnp.concatenate([q_lat, blk.q_rope.astype(dt)], axis=-1)
      logits = matmul.einsum("bshc,bskc->bhsk", query, gathered, dtype=dt, precision=prec, out_dtype=jnp.float32) * spec.scale
      if spec.soft_cap is not None:
        logits = spec.soft_cap * jnp.tanh(logits / spec.soft_cap)
      probs = jax.nn.softmax(jnp.where(valid[:, None], logits, NEG_INF), axis=-1)
      out_latent = matmul.einsum("bhsk,bskr->bshr", probs.astype(dt), gathered[..., :rank], dtype=dt, precision=prec)
      ctx = matmul.einsum("bshr,rhv->bshv", out_latent, kernel[..., nope:], dtype=dt, precision=prec)
      if ix.loss_scale == 0:
        return ctx, jnp.zeros((), jnp.float32)
      picked_scores = jnp.take_along_axis(scores, picked, axis=-1)
      return ctx, indexer_kl(picked_scores, jax.lax.stop_gradient(probs), valid, blk.real)

    return map_query_blocks(block, queries, QUERY_BLOCK, shards)

  def _attention_probs(self, q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """The main attention's probabilities [B, H, S, T] (float32) under mask [B, S, T]."""
    spec = self.spec
    logits = matmul.einsum("bshd,bthd->bhst", q, k, dtype=q.dtype, precision=self.policy.dtypes.precision, out_dtype=jnp.float32) * spec.scale
    if spec.soft_cap is not None:
      logits = spec.soft_cap * jnp.tanh(logits / spec.soft_cap)
    return jax.nn.softmax(jnp.where(mask[:, None], logits, NEG_INF), axis=-1)

  def _decode(self, q_nope, q_rope, latent, k_rope, iq, iw, ik, window, cache: LayerCache, adapter_ids):
    """Prefill or decode step against the cache: the indexer keys are cached beside MLA's (latent or per-head keys and
    values), and each query attends to the top-k of every cached key it may see."""
    spec, ix = self.spec, self.sparse.indexer
    prec, dt = self.policy.dtypes.precision, self.policy.dtypes.compute
    nope = spec.qk_nope_head_dim
    index_key = ik[:, None].astype(dt)  # [B, 1, S, D]
    if "latent" in cache.arrays:
      if self.wkv_b.lora is not None:
        raise ConfigError(
          "decoding MLA from its compressed cache folds wkv_b into the queries, which a LoRA adapter on wkv_b prevents; merge the adapter or set mla_naive_kvcache=true"
        )
      new = jnp.concatenate([latent, k_rope[:, :, 0, :].astype(latent.dtype)], axis=-1)[:, None]
      cache, attended, allowed = cache.update({"latent": new, INDEX_KEY: index_key}, spec.rules, window)
    else:
      kv = self.wkv_b(latent, adapter_ids)
      k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope, kv.shape[:3] + (spec.qk_rope_head_dim,))], axis=-1)
      new = {"key": jnp.swapaxes(k, 1, 2), "value": jnp.swapaxes(kv[..., nope:], 1, 2), INDEX_KEY: index_key}
      cache, attended, allowed = cache.update(new, spec.rules, window)
    scores = self.indexer.scores(iq, iw, attended[INDEX_KEY][:, 0])
    mask = select_topk(scores, allowed, ix.topk)
    if "latent" in cache.arrays:
      kernel = self.wkv_b.kernel[...]
      slots = attended["latent"]
      q_latent = matmul.einsum("bshn,rhn->bshr", q_nope, kernel[..., :nope], dtype=dt, precision=prec)
      query = jnp.concatenate([q_latent, q_rope.astype(dt)], axis=-1)
      out_latent = head_major_attention(query, slots, slots[..., : spec.kv_lora_rank], mask, spec.scale, spec.soft_cap, prec)
      ctx = matmul.einsum("bshr,rhv->bshv", out_latent, kernel[..., nope:], dtype=dt, precision=prec)
    else:
      query = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
      ctx = head_major_attention(query, attended["key"], attended["value"], mask, spec.scale, spec.soft_cap, prec)
    return self.out(ctx, adapter_ids), cache
