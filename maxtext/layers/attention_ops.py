"""Causal dot-product attention kernels behind one entry point, `attend`, chosen by the platform policy.

Kernels (docs/models.md says which runs where, and why):
- `xla`: einsums with a materialised [B, K, G, S, T] float32 score tensor; the reference.
- `chunked`: the same maths over blocks of keys with an online softmax and a hand-written backward,
  so forward and backward hold O(S x block) scores instead of O(S^2) (CPU, long sequences).
- `splash`: TPU Pallas splash attention (inside jax) with segment ids, causal or local masks, GQA, soft cap.
- `cudnn`: GPU cuDNN fused attention; packed documents through cuDNN's segment offsets when the pipeline
  bounds the documents per row (max_segments_per_seq > 0), else through a boolean segment mask.

Attention sinks (gpt-oss): a learned logit per query head joins every softmax row as one more column with no
value, so each row's weights sum to less than one. The XLA, chunked and splash kernels take them (also under
context parallelism, both strategies); cuDNN cannot, and autoselected then falls back to XLA with a logged reason.

The fused kernels mask by token index within the row: they assume positions count up by one inside each
segment, which is what the data pipeline produces (packed or not). The XLA and chunked kernels mask by positions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from maxtext.errors import ConfigError
from maxtext.layers import context_parallel, matmul
from maxtext.mesh import logical_to_spec
from maxtext.platform import Policy

NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)
KERNELS = ("xla", "chunked", "splash", "cudnn")
_log = logging.getLogger("maxtext.attention")
_logged: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _logged:
    _logged.add(message)
    _log.warning(message)


# ----------------------------------------------------------------------------------------------- selection


def unsupported_reason(
  kernel: str, policy: Policy, *, dtype, head_dim: int, q_len: int, kv_len: int, soft_cap: float | None, sinks: bool = False
) -> str | None:
  """Why kernel cannot compute this attention call exactly (None when it can)."""
  if kernel in ("xla", "chunked"):
    return None
  if kernel == "splash":
    if policy.fused_attention != "splash":
      return f"splash attention runs on TPU, not {policy.platform}"
    if q_len % 128:
      return f"splash attention needs a sequence length divisible by 128, got {q_len}"
    return None
  if kernel == "cudnn":
    if policy.fused_attention != "cudnn":
      return f"cuDNN attention needs a GPU, but the target is {policy.platform}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      return f"cuDNN attention needs bfloat16 or float16 activations, got {jnp.dtype(dtype).name}"
    if soft_cap is not None:
      return "cuDNN attention has no logit soft cap"
    if sinks:
      return "cuDNN attention has no attention sinks"
    if head_dim % 8 or head_dim > 128:
      return f"cuDNN attention needs head_dim a multiple of 8 up to 128, got {head_dim}"
    return None
  raise ValueError(f"unknown attention kernel {kernel}")


def select(policy: Policy, *, dtype, head_dim: int, q_len: int, kv_len: int, soft_cap: float | None, sinks: bool = False) -> str:
  """The kernel for one attention call under policy.attention; explicit requests that cannot be met are ConfigErrors.

  autoselected: the platform's fused kernel (splash on TPU, cuDNN on GPU, chunked on CPU for long sequences),
  else XLA with a one-time log line. flash: the fused kernel (the chunked kernel on CPU). cudnn: cuDNN.
  dot_product: XLA. Queries shorter than the keys (decoding against a cache) run XLA under every request.
  """
  request = policy.attention
  if request == "dot_product":
    return "xla"
  if q_len != kv_len:  # queries against a longer key/value cache (decoding): the fused kernels here are self-attention
    _log_once(f"attention: {q_len} queries against {kv_len} keys run XLA dot-product attention")
    return "xla"
  facts = dict(dtype=dtype, head_dim=head_dim, q_len=q_len, kv_len=kv_len, soft_cap=soft_cap, sinks=sinks)
  if request == "cudnn":
    reason = unsupported_reason("cudnn", policy, **facts)
    if reason:
      raise ConfigError(f"attention=cudnn cannot run this model: {reason}; use attention=autoselected")
    return "cudnn"
  fused = policy.fused_attention
  if request == "flash":
    reason = unsupported_reason(fused, policy, **facts)
    if reason:
      raise ConfigError(f"attention=flash cannot run this model: {reason}; use attention=autoselected or attention=dot_product")
    return fused
  if request != "autoselected":
    raise ValueError(f"unknown attention {request}")
  if fused == "chunked":
    return "chunked" if policy.chunked_attention_from and q_len >= policy.chunked_attention_from else "xla"
  reason = unsupported_reason(fused, policy, **facts)
  if reason:
    _log_once(f"attention: {fused} cannot run this call ({reason}); falling back to XLA dot-product attention")
    return "xla"
  return fused


# ------------------------------------------------------------------------------------------------- entry point


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  q_positions: jax.Array,
  kv_positions: jax.Array,
  segment_ids: jax.Array | None,
  window: int | jax.Array,
  soft_cap: float | None,
  scale: float,
  policy: Policy,
  precision: jax.lax.Precision | None = None,
  window_choices: Sequence[int] = (),
  rules: Sequence | None = None,
  sinks: jax.Array | None = None,
  context: context_parallel.Layout | None = None,
) -> jax.Array:
  """Causal attention q [B,S,H,D], k [B,T,K,D], v [B,T,K,Dv] (H a multiple of K) -> [B,S,H,Dv] in q's dtype.

  positions [B,S]/[B,T] int; segment_ids [B,S] (self-attention, 0 = padding) or None; window: attend to keys with
  q_pos - kv_pos < window (0 = unbounded), an int or a traced scalar taking one of window_choices (scanned layers
  with mixed windows); soft_cap: cap * tanh(logits / cap) or None; scale multiplies q.k. rules: logical axis
  rules that place the fused kernels' shard_map (batch and heads) under an active mesh. sinks [H]: each head's
  sink logit (None: no sinks). context: the sequence's context-parallel layout; self-attention over a
  `context`-sharded mesh then gathers or rings the keys and values (maxtext.layers.context_parallel).
  """
  if context_parallel.is_active(context, q.shape[1], k.shape[1]):  # self-attention: kv_positions are q_positions
    return context_parallel.attend(q, k, v, q_positions, segment_ids, window, context, soft_cap, scale, policy, precision, window_choices, rules, sinks)
  kernel = select(policy, dtype=q.dtype, head_dim=q.shape[-1], q_len=q.shape[1], kv_len=k.shape[1], soft_cap=soft_cap, sinks=sinks is not None)
  if kernel == "xla":
    mask = attention_mask(q_positions, kv_positions, segment_ids, window)
    return xla_attention(q, k, v, mask, scale, soft_cap, precision, policy.integer_bf16_rounding, sinks)
  v_dim = v.shape[-1]
  if v_dim != q.shape[-1]:  # the other kernels take one head width: zero value columns, cut from the result (MLA)
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - v_dim)))
  if kernel == "chunked":
    out = chunked_attention(q, k, v, q_positions, kv_positions, segment_ids, window, scale, soft_cap, policy.attention_key_block, sinks)
  else:
    if kernel == "splash":
      run = functools.partial(splash_attention, scale=scale, soft_cap=soft_cap, blocks=policy.splash, interpret=policy.interpret_kernels)
    else:
      run = functools.partial(cudnn_attention, scale=scale, max_segments=policy.max_segments_per_seq)
    segments = segment_ids if segment_ids is not None else jnp.ones(q.shape[:2], jnp.int32)
    out = _per_window(run, q, k, v, segments, sinks, window, window_choices, rules)
  return out[..., :v_dim]


def _per_window(run, q, k, v, segments, sinks, window, window_choices, rules) -> jax.Array:
  """run(q, k, v, segments, sinks, window=int) under a batch/head shard_map; a traced window switches between window_choices."""

  def local(q, k, v, segments, sinks):
    if isinstance(window, int):
      return run(q, k, v, segments, sinks, window=window)
    choices = sorted(set(window_choices))
    if not choices:
      raise ValueError("a traced window needs window_choices")
    index = sum(jnp.where(window == w, i, 0) for i, w in enumerate(choices))
    return jax.lax.switch(index, [functools.partial(run, window=w) for w in choices], q, k, v, segments, sinks)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or rules is None:
    return local(q, k, v, segments, sinks)
  qs = logical_to_spec(("activation_batch", None, "activation_heads", None), rules, mesh)
  kvs = logical_to_spec(("activation_batch", None, "activation_kv_heads", None), rules, mesh)
  ss = logical_to_spec(("activation_batch", None), rules, mesh)
  hs = None if sinks is None else logical_to_spec(("activation_heads",), rules, mesh)
  if not isinstance(window, int):  # the traced window enters the shard_map replicated
    w_local = jax.shard_map(
      lambda q, k, v, s, h, w: _per_window(run, q, k, v, s, h, w, window_choices, None),
      mesh=mesh,
      in_specs=(qs, kvs, kvs, ss, hs, jax.sharding.PartitionSpec()),
      out_specs=qs,
      check_vma=False,
    )
    return w_local(q, k, v, segments, sinks, window)
  return jax.shard_map(local, mesh=mesh, in_specs=(qs, kvs, kvs, ss, hs), out_specs=qs, check_vma=False)(q, k, v, segments, sinks)


# ----------------------------------------------------------------------------------------------- XLA reference


def attention_mask(
  q_pos: jax.Array, kv_pos: jax.Array, segment_ids: jax.Array | None, window: int | jax.Array, kv_segment_ids: jax.Array | None = None
) -> jax.Array:
  """Boolean [B, 1, 1, S, T]: causal, same segment, and within the sliding window (window 0 = full).
  kv_segment_ids: the keys' own segment ids when they are not the queries' sequence (default segment_ids)."""
  kv_segments = kv_segment_ids if kv_segment_ids is not None else segment_ids
  return _mask(q_pos, kv_pos, segment_ids, kv_segments, window)[:, None, None, :, :]


def _mask(q_pos, kv_pos, q_seg, kv_seg, window) -> jax.Array:
  """Boolean [B, S, T] from positions, optional segment ids and window."""
  allowed = kv_pos[:, None, :] <= q_pos[:, :, None]
  if q_seg is not None:
    allowed &= q_seg[:, :, None] == kv_seg[:, None, :]
  if not (isinstance(window, int) and window == 0):
    in_window = (q_pos[:, :, None] - kv_pos[:, None, :]) < window
    allowed &= in_window | (jnp.asarray(window) == 0)
  return allowed


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


# ------------------------------------------------------------------------------------------ chunked (O(S) memory)


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
  mask = _mask(q_pos, pos_blk, q_seg, seg_blk, 0)
  mask &= ((q_pos[:, :, None] - pos_blk[:, None, :]) < window) | (window == 0)
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


# ------------------------------------------------------------------------------------------------ TPU: splash


# Not cached here: the kernel holds its mask as jax arrays made during the trace that built it, and a later trace
# (remat_policy=auto compiles the step several times in one process) would capture them as hoisted constants that
# the compiled step then expects as extra inputs. jax caches the costly mask processing itself (numpy).
def _splash_kernel(heads: int, q_len: int, kv_len: int, window: int, soft_cap: float | None, blocks, interpret: bool):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

  if window:
    mask = mask_lib.LocalMask((q_len, kv_len), window_size=(window - 1, 0), offset=0)
  else:
    mask = mask_lib.CausalMask((q_len, kv_len))

  def fit(size: int, length: int) -> int:
    return min(size, length)

  sizes = kernel_lib.BlockSizes(
    block_q=fit(blocks.block_q, q_len),
    block_kv=fit(blocks.block_kv, kv_len),
    block_kv_compute=fit(blocks.block_kv_compute, kv_len),
    block_q_dkv=fit(blocks.block_q_dkv, q_len),
    block_kv_dkv=fit(blocks.block_kv_dkv, kv_len),
    block_kv_dkv_compute=fit(blocks.block_kv_dkv_compute, kv_len),
    block_q_dq=None if blocks.use_fused_bwd_kernel else fit(blocks.block_q_dq, q_len),
    block_kv_dq=None if blocks.use_fused_bwd_kernel else fit(blocks.block_kv_dq, kv_len),
    use_fused_bwd_kernel=blocks.use_fused_bwd_kernel,
  )
  multi = mask_lib.MultiHeadMask([mask] * heads)
  return kernel_lib.make_splash_mha(multi, block_sizes=sizes, head_shards=1, q_seq_shards=1, attn_logits_soft_cap=soft_cap, interpret=interpret)


def splash_attention(q, k, v, segments, sinks=None, *, window: int, scale: float, soft_cap: float | None, blocks, interpret: bool) -> jax.Array:
  """Splash attention over local shards: q [B,S,H,D], k/v [B,T,K,D], segments [B,S], sinks [H] or None -> [B,S,H,D]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

  kernel = _splash_kernel(q.shape[2], q.shape[1], k.shape[1], int(window), soft_cap, blocks, interpret)
  qh = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)  # [B,H,S,D]; splash does not scale
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

  def one(q1, k1, v1, s1):
    return kernel(q1, k1, v1, segment_ids=kernel_lib.SegmentIds(q=s1, kv=s1), sinks=sinks)

  return jnp.swapaxes(jax.vmap(one)(qh, kh, vh, segments), 1, 2)


# --------------------------------------------------------------------------------------------------- GPU: cuDNN


def segment_mask(segments: jax.Array) -> jax.Array:
  """Boolean [B, 1, S, S]: query and key in the same segment (cuDNN adds causality and the window itself)."""
  return (segments[:, :, None] == segments[:, None, :])[:, None]


def packed_offsets(segments: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array]:
  """cuDNN packed-sequence layout of each row's runs of equal segment ids (documents, then the padding run).

  Returns (offsets [B, max_runs + 1], lengths [B, max_runs]) int32: the start index and length of each run,
  -1 past the row's last run. A row with more than max_runs runs is beyond the bound the caller promised;
  its extra runs are folded into the last one.
  """
  b, s = segments.shape
  starts = jnp.concatenate([jnp.ones((b, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
  run = jnp.minimum(jnp.cumsum(starts, axis=1) - 1, max_runs - 1)  # [B,S]
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
  lengths = jnp.zeros((b, max_runs), jnp.int32).at[rows, run].add(1)
  count = jnp.minimum(jnp.sum(starts, axis=1), max_runs)
  lengths = jnp.where(jnp.arange(max_runs)[None] < count[:, None], lengths, -1)
  index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
  first = jnp.full((b, max_runs + 1), s, jnp.int32).at[rows, run].min(index)
  offsets = jnp.where(jnp.arange(max_runs + 1)[None] < count[:, None], first, -1)
  return offsets.astype(jnp.int32), lengths.astype(jnp.int32)


def cudnn_attention(q, k, v, segments, sinks=None, *, window: int, scale: float, max_segments: int, implementation: str = "cudnn") -> jax.Array:
  """cuDNN fused causal attention that honours segments: packed offsets when max_segments > 0 and no window,
  else a boolean segment mask. implementation='xla' runs the mask path through XLA (CPU tests). No sinks (select
  never picks cuDNN for a model with them)."""
  if sinks is not None:
    raise ValueError("cuDNN attention has no attention sinks")
  if max_segments > 0 and not window and implementation == "cudnn":
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa

    offsets, lengths = packed_offsets(segments, max_segments + 1)  # + 1: the padding run after the documents
    return cudnn_dpa(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets, scale=scale, mask_type=MaskType.PADDING_CAUSAL)
  local = (window - 1, 0) if window else None
  mask = segment_mask(segments)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True, local_window_size=local, implementation=implementation)


def offsets_mask(offsets: jax.Array, lengths: jax.Array, length: int) -> jax.Array:
  """Boolean [B, S, S] that cuDNN's packed layout (offsets, lengths) plus causality allows (tests check the construction)."""
  index = jnp.arange(length)
  starts, ends = offsets[:, :-1], offsets[:, :-1] + lengths  # [B, M]
  member = (index[None, None, :] >= starts[:, :, None]) & (index[None, None, :] < ends[:, :, None]) & (lengths[:, :, None] > 0)  # [B,M,S]
  same = jnp.einsum("bms,bmt->bst", member.astype(jnp.int32), member.astype(jnp.int32)) > 0
  return same & (index[None, None, :] <= index[None, :, None])
