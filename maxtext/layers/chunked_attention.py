"""The chunked attention kernel (`chunked`): xla_attention's maths over blocks of keys with an online softmax and a
hand-written backward, so forward and backward hold O(S x block) scores instead of O(S^2) (CPU, long sequences).
Context parallelism's ring (maxtext.layers.context_parallel) runs its blocks (`ChunkedBlocks`) shard by shard."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from maxtext.layers.xla_attention import NEG_INF, position_mask, span_mask


def chunked_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_pos: jax.Array,
  kv_pos: jax.Array,
  segment_ids: jax.Array | None,
  window: int | jax.Array,
  scale: float,
  soft_cap: float | None,
  block: int,
  sinks: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """xla_attention's result, computed over blocks of `block` keys with an online softmax (forward and backward).

  Scores never exist beyond one [B, K, G, S, block] float32 tile; the backward recomputes them from the saved
  log-sum-exp. Keys are padded to a multiple of block (padding is masked out). Sinks [H] start each row's running
  max and sum (a sink of -inf, the default, adds nothing). kv_segment_ids: the keys' segment ids when the keys are
  not the queries' own sequence (context parallelism); default segment_ids.
  """
  blocks = ChunkedBlocks.of(q, k, v, q_pos, kv_pos, segment_ids, kv_segment_ids, block, sinks)
  out = _chunked(*blocks.operands, jnp.asarray(window, jnp.int32), blocks.sink, scale, soft_cap)
  return blocks.from_heads(out)


@dataclasses.dataclass(frozen=True)
class ChunkedBlocks:
  """The chunked kernel's operands: queries head-major [B,K,G,S,D], keys and values in blocks [N,B,K,C,D], positions
  and segment ids per query [B,S] and per key block [N,B,C], each head's sink logit [K,G] (-inf: none); `t` keys
  before padding."""

  qh: jax.Array
  kb: jax.Array
  vb: jax.Array
  q_pos: jax.Array
  pos_b: jax.Array
  q_seg: jax.Array
  seg_b: jax.Array
  sink: jax.Array
  t: int

  @property
  def operands(self) -> tuple[jax.Array, ...]:
    return (self.qh, self.kb, self.vb, self.q_pos, self.pos_b, self.q_seg, self.seg_b)

  @classmethod
  def of(cls, q, k, v, q_pos, kv_pos, q_seg, kv_seg, block: int, sinks: jax.Array | None = None) -> ChunkedBlocks:
    b, s, h, d = q.shape
    t, kv_heads = k.shape[1], k.shape[2]
    block = min(block, t)
    pad = -t % block
    kv_seg = kv_seg if kv_seg is not None else q_seg
    q_seg = q_seg if q_seg is not None else jnp.zeros((b, s), jnp.int32)
    kv_seg = kv_seg if kv_seg is not None else jnp.zeros((b, t), jnp.int32)
    if pad:
      k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
      v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
      kv_pos = jnp.pad(kv_pos, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max)  # never <= a query position
      kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad)))
    n = (t + pad) // block
    qh = jnp.transpose(q.reshape(b, s, kv_heads, h // kv_heads, d), (0, 2, 3, 1, 4))  # [B,K,G,S,D]
    kb = jnp.transpose(k.reshape(b, n, block, kv_heads, d), (1, 0, 3, 2, 4))  # [N,B,K,C,D]
    vb = jnp.transpose(v.reshape(b, n, block, kv_heads, v.shape[-1]), (1, 0, 3, 2, 4))
    pos_b = jnp.transpose(kv_pos.reshape(b, n, block), (1, 0, 2))  # [N,B,C]
    seg_b = jnp.transpose(kv_seg.reshape(b, n, block), (1, 0, 2))
    sink = jnp.full((h,), -jnp.inf, jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    return cls(qh, kb, vb, q_pos, pos_b, q_seg, seg_b, sink.reshape(kv_heads, h // kv_heads), t)

  def from_heads(self, x: jax.Array) -> jax.Array:
    """[B,K,G,S,D] -> [B,S,H,D]."""
    b, kv, g, s, d = x.shape
    return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(b, s, kv * g, d)

  def to_heads(self, x: jax.Array) -> jax.Array:
    """[B,S,H,D] -> [B,K,G,S,D]."""
    _, kv, g, _, _ = self.qh.shape
    b, s, _, d = x.shape
    return jnp.transpose(x.reshape(b, s, kv, g, d), (0, 2, 3, 1, 4))

  def from_blocks(self, x: jax.Array) -> jax.Array:
    """Key blocks [N,B,K,C,D] -> [B,T,K,D] (padding cut)."""
    n, b, kv, c, d = x.shape
    return jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(b, n * c, kv, d)[:, : self.t]

  def forward(self, window, scale: float, soft_cap: float | None) -> tuple[jax.Array, jax.Array]:
    """(float32 output [B,K,G,S,D], log-sum-exp [B,K,G,S]) of the queries over these keys (and the sinks) alone."""
    return _chunked_stats(*self.operands, jnp.asarray(window, jnp.int32), self.sink, scale, soft_cap)

  def backward(
    self, window, scale: float, soft_cap: float | None, out: jax.Array, lse: jax.Array, g: jax.Array
  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(dq [B,S,H,D], dk [B,T,K,D], dv, dsinks [H]) of these keys' (and sinks') share of an attention whose softmax
    spans more keys: out and lse [B,K,G,S] are the whole attention's (head-major), g its output cotangent [B,S,H,D]
    (the ring's backward). dsinks is 0 for blocks built without sinks."""
    residuals = (*self.operands, jnp.asarray(window, jnp.int32), self.sink, out, lse)
    dq, dk, dv, *_, dsink = _chunked_backward(scale, soft_cap, residuals, self.to_heads(g))
    return self.from_heads(dq), self.from_blocks(dk), self.from_blocks(dv), dsink.reshape(-1)


def _tile(q, k_blk, q_pos, pos_blk, q_seg, seg_blk, window, scale, soft_cap):
  """(capped float32 logits [B,K,G,S,C], mask [B,1,1,S,C]) of one key block."""
  logits = jnp.einsum("bkgsd,bkcd->bkgsc", q, k_blk, preferred_element_type=jnp.float32) * scale
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  mask = position_mask(q_pos, pos_blk, q_seg, seg_blk, 0)
  mask &= span_mask(q_pos, pos_blk, window)  # sliding window (> 0) or chunk (< 0)
  return logits, mask[:, None, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _chunked(q, kb, vb, q_pos, pos_b, q_seg, seg_b, window, sink, scale, soft_cap):
  return _chunked_forward(q, kb, vb, q_pos, pos_b, q_seg, seg_b, window, sink, scale, soft_cap)[0]


def _chunked_stats(q, kb, vb, q_pos, pos_b, q_seg, seg_b, window, sink, scale, soft_cap) -> tuple[jax.Array, jax.Array]:
  """The online softmax over the key blocks: (float32 output [B,K,G,S,D], log-sum-exp [B,K,G,S]); sink [K,G]."""
  stats = q.shape[:-1]  # [B,K,G,S]
  m0 = jnp.maximum(jnp.broadcast_to(sink[None, :, :, None], stats), NEG_INF)  # the sink is the first logit of every row

  def step(carry, xs):
    m, total, acc = carry
    k_blk, v_blk, pos_blk, seg_blk = xs
    logits, mask = _tile(q, k_blk, q_pos, pos_blk, q_seg, seg_blk, window, scale, soft_cap)
    m_new = jnp.maximum(m, jnp.max(jnp.where(mask, logits, NEG_INF), axis=-1))
    p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    total = total * correction + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgsc,bkcd->bkgsd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return (m_new, total, acc * correction[..., None] + pv), None

  init = (m0, jnp.exp(sink[None, :, :, None] - m0), jnp.zeros((*stats, vb.shape[-1]), jnp.float32))
  (m, total, acc), _ = jax.lax.scan(step, init, (kb, vb, pos_b, seg_b))
  total = jnp.maximum(total, jnp.finfo(jnp.float32).tiny)  # rows without a visible key (padding, or a ring block) get 0
  return acc / total[..., None], m + jnp.log(total)


def _chunked_forward(q, kb, vb, q_pos, pos_b, q_seg, seg_b, window, sink, scale, soft_cap):
  out, lse = _chunked_stats(q, kb, vb, q_pos, pos_b, q_seg, seg_b, window, sink, scale, soft_cap)
  out = out.astype(q.dtype)
  return out, (q, kb, vb, q_pos, pos_b, q_seg, seg_b, window, sink, out, lse)


def _chunked_backward(scale, soft_cap, residuals, g):
  q, kb, vb, q_pos, pos_b, q_seg, seg_b, window, sink, out, lse = residuals
  g32 = g.astype(jnp.float32)
  delta = jnp.sum(g32 * out.astype(jnp.float32), axis=-1)  # [B,K,G,S]: rowsum(dO * O)
  dsink = -jnp.sum(jnp.exp(sink[None, :, :, None] - lse) * delta, axis=(0, 3))  # d out / d sink = -p_sink out

  def step(dq, xs):
    k_blk, v_blk, pos_blk, seg_blk = xs
    logits, mask = _tile(q, k_blk, q_pos, pos_blk, q_seg, seg_blk, window, scale, soft_cap)
    p = jnp.where(mask, jnp.exp(logits - lse[..., None]), 0.0)
    dv = jnp.einsum("bkgsc,bkgsd->bkcd", p.astype(g.dtype), g, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgsd,bkcd->bkgsc", g, v_blk, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    if soft_cap is not None:
      ds = ds * (1.0 - jnp.square(logits / soft_cap))
    ds = (ds * scale).astype(q.dtype)
    dq = dq + jnp.einsum("bkgsc,bkcd->bkgsd", ds, k_blk, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgsc,bkgsd->bkcd", ds, q, preferred_element_type=jnp.float32)
    return dq, (dk.astype(k_blk.dtype), dv.astype(v_blk.dtype))

  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32), (kb, vb, pos_b, seg_b))
  return dq.astype(q.dtype), dk, dv, None, None, None, None, None, dsink


_chunked.defvjp(_chunked_forward, _chunked_backward)
