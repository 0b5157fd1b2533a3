"""Context parallelism: self-attention over a sequence split across the `context` mesh axis.

With c shards each device holds S / c queries, keys and values of every row (activations are split over `context`
along the sequence everywhere; weights are FSDP-sharded over it). Attention is the one place the shards meet:

- all_gather: keys, values, their positions and segment ids are gathered along the sequence; each shard attends
  its own queries to all keys with the platform's fused kernel (splash on TPU with the mask's query positions
  sharded with the queries, cuDNN on GPU with a mask built from positions, the chunked kernel on CPU).
- ring: c steps; at step t shard i attends to the key/value block that started on shard (i - t) mod c while the
  next block moves on with a ppermute. Blocks are merged by their log-sum-exp: o = sum_t exp(lse_t - lse) o_t with
  lse = logsumexp_t lse_t. The backward pass visits the blocks again, each block's dq, dk, dv computed from the
  merged output and log-sum-exp (flash attention's backward); dK and dV travel with their block back to its owner.

Attention sinks (gpt-oss) are one more logit per head in every row's softmax: the all-gather path hands them to the
kernel; the ring counts them once, with the shard's own block (chunked) or as a last block of one logit and no
value (splash), and their gradient comes from the merged output and log-sum-exp.

Load balance (context_parallel_load_balance, MaxText's dual-chunk swap): the sequence is cut into 2c chunks and shard i
holds chunks i and 2c - 1 - i, so every shard has the same causal work. The train and eval steps reorder the batch's
per-token arrays on entry (`reorder_batch`); the loss, a sum over tokens, is computed in that order, and per-token
outputs (multi-token prediction's shifted targets) are put back with `restore`. The model's call (logits) runs
inside `in_shard_order`, the wrapper that reorders its inputs and restores its outputs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxtext.layers.chunked_attention import ChunkedBlocks, chunked_attention
from maxtext.layers.sharding import logical_to_spec
from maxtext.layers.xla_attention import attention_mask, xla_attention
from maxtext.platform import Policy

CONTEXT_AXIS = "context"
PER_TOKEN_KEYS = ("inputs", "targets", "inputs_position", "targets_position", "inputs_segmentation", "targets_segmentation", "adapter_ids")


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the sequence is split: shards along `context`, the attention strategy, and the dual-chunk load balance
  (maxtext.models.common_specs.context_layout reads it from the config)."""

  shards: int
  strategy: str = "all_gather"
  load_balance: bool = True

  def order(self, length: int) -> np.ndarray:
    """order[i] = the natural position held at index i of the reordered sequence (identity without load balance)."""
    if not self.load_balance:
      return np.arange(length)
    chunks = np.arange(length).reshape(2 * self.shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * self.shards - 1 - i]]) for i in range(self.shards)])

  def reorder(self, x: jax.Array, axis: int = 1) -> jax.Array:
    """x in natural sequence order -> the order the shards hold (a no-op without load balance)."""
    return x if not self.load_balance else jnp.take(x, self.order(x.shape[axis]), axis=axis)

  def restore(self, x: jax.Array, axis: int = 1) -> jax.Array:
    """The inverse of reorder: per-token results back in natural order."""
    return x if not self.load_balance else jnp.take(x, np.argsort(self.order(x.shape[axis])), axis=axis)


def reorder_batch(batch: dict[str, jax.Array], layout: Layout | None) -> dict[str, jax.Array]:
  """The batch with its per-token arrays ([B, S]) in the layout's order (the step's entry); per-row arrays unchanged."""
  if layout is None or not layout.load_balance:
    return batch
  length = batch["inputs"].shape[1]
  return {k: layout.reorder(v) if k in PER_TOKEN_KEYS and v.ndim == 2 and v.shape[1] == length else v for k, v in batch.items()}


PerTokenForward = Callable[[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None], jax.Array]


def in_shard_order(layout: Layout | None, forward: PerTokenForward) -> PerTokenForward:
  """The load-balance wrapper around a model call: forward(tokens, positions, segment_ids, adapter_ids) -> per-token
  outputs [B, S, ...], run on the sequence in the shards' order (tokens, positions and the per-token [B, S] ids
  reordered; per-row adapter ids [B] as they are) with its outputs put back in natural order. forward itself
  without a layout or without load balance."""
  if layout is None or not layout.load_balance:
    return forward

  def per_token(x: jax.Array | None) -> jax.Array | None:
    return layout.reorder(x) if x is not None and x.ndim == 2 else x

  def wrapped(tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None) -> jax.Array:
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return layout.restore(forward(layout.reorder(tokens), layout.reorder(positions), per_token(segment_ids), per_token(adapter_ids)))

  return wrapped


def is_active(layout: Layout | None, q_len: int, kv_len: int) -> bool:
  """Whether attention runs context-parallel: a layout, a mesh with a split `context` axis, and self-attention."""
  if layout is None or q_len != kv_len:
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.shape.get(CONTEXT_AXIS, 1) > 1


# ------------------------------------------------------------------------------------------------- entry point


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array | None,
  window: int | jax.Array,
  layout: Layout,
  soft_cap: float | None,
  scale: float,
  policy: Policy,
  kernel: str,
  precision: jax.lax.Precision | None,
  window_choices: Sequence[int],
  rules: Sequence,
  sinks: jax.Array | None = None,
) -> jax.Array:
  """attention_ops.attend's self-attention (positions [B,S] shared by queries and keys; sinks [H] or None) over a
  context-sharded sequence (see the module docstring), with the kernel attention_ops.select chose."""
  mesh = jax.sharding.get_abstract_mesh()
  shards = mesh.shape[CONTEXT_AXIS]
  segments = segment_ids if segment_ids is not None else jnp.ones(q.shape[:2], jnp.int32)
  batch_axes = logical_to_spec(("activation_batch",), rules, mesh)[0]
  q_heads = logical_to_spec(("activation_heads",), rules, mesh)[0]
  kv_heads = logical_to_spec(("activation_kv_heads",), rules, mesh)[0]
  qs, kvs = PartitionSpec(batch_axes, CONTEXT_AXIS, q_heads, None), PartitionSpec(batch_axes, CONTEXT_AXIS, kv_heads, None)
  rows = PartitionSpec(batch_axes, CONTEXT_AXIS)
  heads = None if sinks is None else PartitionSpec(q_heads)
  traced_window = not isinstance(window, int)
  w = jnp.asarray(window, jnp.int32)

  if kernel == "splash":
    return _splash(q, k, v, segments, sinks, window, window_choices, scale, soft_cap, policy, layout, mesh, (qs, kvs, rows, q_heads, heads))

  if layout.strategy == "ring":  # merging blocks needs each block's log-sum-exp: the chunked kernel (also on GPU)

    def local(q, k, v, qp, kp, seg, sinks, w):
      return _ring(q, k, v, qp, kp, seg, sinks, w, scale, soft_cap, policy.attention_key_block, shards)

  else:

    def local(q, k, v, qp, kp, seg, sinks, w):
      gather = functools.partial(jax.lax.all_gather, axis_name=CONTEXT_AXIS, axis=1, tiled=True)
      k, v, kp, kv_seg = gather(k), gather(v), gather(kp), gather(seg)
      w = w if traced_window else window
      if kernel == "xla":
        mask = attention_mask(qp, kp, seg, w, kv_segment_ids=kv_seg)
        return xla_attention(q, k, v, mask, scale, soft_cap, precision, policy.integer_bf16_rounding, sinks)
      if kernel == "cudnn":  # keys in shard order: the mask comes from positions and segment ids, window included (no sinks: select)
        mask = attention_mask(qp, kp, seg, w, kv_segment_ids=kv_seg)[:, 0]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")
      return chunked_attention(q, k, v, qp, kp, seg, w, scale, soft_cap, policy.attention_key_block, sinks, kv_segment_ids=kv_seg)

  fn = jax.shard_map(local, mesh=mesh, in_specs=(qs, kvs, kvs, rows, rows, rows, heads, PartitionSpec()), out_specs=qs, check_vma=False)
  return fn(q, k, v, positions, positions, segments, sinks, w)


# ------------------------------------------------------------------------------------------------ ring (chunked)


def _rotate(x, shards: int):
  """Send every shard's block to the next shard along `context`."""
  return jax.lax.ppermute(x, CONTEXT_AXIS, [(i, (i + 1) % shards) for i in range(shards)])


def _merge(out, lse, out_t, lse_t):
  """Two partial attentions over disjoint keys -> one, by their log-sum-exp (float32, head-major)."""
  new = jnp.logaddexp(lse, lse_t)
  return out * jnp.exp(lse - new)[..., None] + out_t * jnp.exp(lse_t - new)[..., None], new


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _ring(q, k, v, q_pos, kv_pos, seg, sinks, window, scale, soft_cap, block, shards):
  return _ring_forward(q, k, v, q_pos, kv_pos, seg, sinks, window, scale, soft_cap, block, shards)[0]


def _ring_blocks(q, blocks, q_pos, seg, sinks, block: int, t: int):
  """Ring step t's chunked operands; the sinks join the first step's block only (they count once per row)."""
  k, v, kv_pos, kv_seg = blocks
  return ChunkedBlocks.of(q, k, v, q_pos, kv_pos, seg, kv_seg, block, sinks if t == 0 else None)


def _ring_forward(q, k, v, q_pos, kv_pos, seg, sinks, window, scale, soft_cap, block, shards):
  out = lse = None
  blocks = (k, v, kv_pos, seg)
  for t in range(shards):
    incoming = jax.tree.map(lambda x: _rotate(x, shards), blocks) if t < shards - 1 else None  # issued before the block's attention
    chunked = _ring_blocks(q, blocks, q_pos, seg, sinks, block, t)
    out_t, lse_t = chunked.forward(window, scale, soft_cap)
    out, lse = (out_t, lse_t) if out is None else _merge(out, lse, out_t, lse_t)
    blocks = incoming
  result = chunked.from_heads(out).astype(q.dtype)
  return result, (q, k, v, q_pos, kv_pos, seg, sinks, window, result, lse)


def _ring_backward(scale, soft_cap, block, shards, residuals, g):
  q, k, v, q_pos, kv_pos, seg, sinks, window, out, lse = residuals
  dq = jnp.zeros(q.shape, jnp.float32)
  blocks = (k, v, kv_pos, seg)
  dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  dsinks = None
  for t in range(shards):
    incoming = jax.tree.map(lambda x: _rotate(x, shards), blocks) if t < shards - 1 else None
    chunked = _ring_blocks(q, blocks, q_pos, seg, sinks, block, t)
    dq_t, dk_t, dv_t, dsinks_t = chunked.backward(window, scale, soft_cap, chunked.to_heads(out), lse, g)
    if t == 0 and sinks is not None:
      dsinks = dsinks_t.astype(sinks.dtype)
    dq = dq + dq_t.astype(jnp.float32)
    dk, dv = _rotate(dk + dk_t.astype(jnp.float32), shards), _rotate(dv + dv_t.astype(jnp.float32), shards)  # with its block
    blocks = incoming
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, dsinks, None


_ring.defvjp(_ring_forward, _ring_backward)


# ------------------------------------------------------------------------------------------------------ TPU: splash
#
# The kernels are built for the global query sequence with q_seq_shards = shards: their mask info, including the
# query positions (`q_sequence`) the in-kernel mask reads, is split with the queries by shard_map
# (kernel.manual_sharding_spec), so one static mask serves every shard. Masks compare query positions with key
# indices: the all-gather path puts the gathered keys back in natural order; a ring block's kernel holds, per query
# row, its position minus the first position of the key chunk that row's shard sees at that step.


def _splash_mask(shape: tuple[int, int], window: int, q_sequence: np.ndarray):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

  mask = mask_lib.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window else mask_lib.CausalMask(shape)
  mask.q_sequence = np.asarray(q_sequence, np.int32)
  return mask


def _splash_kernel(mask, heads: int, head_shards: int, shards: int, soft_cap: float | None, blocks, interpret: bool, shrink: bool = True):
  """A splash kernel for the global mask, its mask info split over `shards` query shards. shrink=False keeps the
  full block grid of every shard (ring steps leave some shards no visible key, which splash's grid shrinking refuses)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib

  q_len, kv_len = mask.shape
  fit = lambda size, length: min(size, length)  # noqa: E731
  sizes = kernel_lib.BlockSizes(
    block_q=fit(blocks.block_q, q_len // shards),
    block_kv=fit(blocks.block_kv, kv_len),
    block_kv_compute=fit(blocks.block_kv_compute, kv_len),
    block_q_dkv=fit(blocks.block_q_dkv, q_len // shards),
    block_kv_dkv=fit(blocks.block_kv_dkv, kv_len),
    block_kv_dkv_compute=fit(blocks.block_kv_dkv_compute, kv_len),
    block_q_dq=None if blocks.use_fused_bwd_kernel else fit(blocks.block_q_dq, q_len // shards),
    block_kv_dq=None if blocks.use_fused_bwd_kernel else fit(blocks.block_kv_dq, kv_len),
    use_fused_bwd_kernel=blocks.use_fused_bwd_kernel,
  )
  multi = mask_lib.MultiHeadMask([mask] * heads)
  if shrink:
    return kernel_lib.make_splash_mha(
      multi, block_sizes=sizes, head_shards=head_shards, q_seq_shards=shards, attn_logits_soft_cap=soft_cap, interpret=interpret
    )
  split = dict(head_shards=head_shards, q_seq_shards=shards, shrink_grid=False)
  fwd, mask_function = info_lib.process_mask(multi, (sizes.block_q, sizes.block_kv), **split)
  dq = None if sizes.use_fused_bwd_kernel else info_lib.process_mask(multi, (sizes.block_q_dq, sizes.block_kv_dq), **split)[0]
  dkv = info_lib.process_mask_dkv(multi, (sizes.block_q_dkv, sizes.block_kv_dkv), **split)[0]
  as_arrays = lambda info: None if info is None else jax.tree.map(jnp.array, info)  # noqa: E731
  return kernel_lib.SplashAttentionKernel(
    as_arrays(fwd),
    as_arrays(dq),
    as_arrays(dkv),
    block_sizes=sizes,
    is_mqa=False,
    save_residuals=False,
    mask_value=kernel_lib.DEFAULT_MASK_VALUE,
    attn_logits_soft_cap=soft_cap,
    residual_checkpoint_name=None,
    mask_function=mask_function,
    interpret=interpret,
  )


def _ring_bases(layout: Layout, length: int, step: int) -> list[np.ndarray]:
  """Per key chunk of a ring block (two with load balance), each query row's first visible key position at `step`."""
  shards = layout.shards
  shard = np.arange(length) // (length // shards)
  source = (shard - step) % shards  # the shard whose block this row's shard holds at `step`
  if not layout.load_balance:
    return [source * (length // shards)]
  chunk = length // (2 * shards)
  return [source * chunk, (2 * shards - 1 - source) * chunk]


def _splash(q, k, v, segments, sinks, window, window_choices, scale, soft_cap, policy, layout, mesh, specs) -> jax.Array:
  """Splash attention over the context-sharded sequence: all_gather or ring (see the section comment)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

  qs, kvs, rows, head_axes, sink_spec = specs
  length, heads = q.shape[1], q.shape[2]
  names = (head_axes,) if isinstance(head_axes, str) else tuple(head_axes or ())
  head_shards = int(np.prod([mesh.shape[a] for a in names])) if names else 1
  order = layout.order(length)
  windows = [int(window)] if isinstance(window, int) else sorted(set(window_choices))
  make = functools.partial(
    _splash_kernel, heads=heads, head_shards=head_shards, shards=layout.shards, soft_cap=soft_cap, blocks=policy.splash, interpret=policy.interpret_kernels
  )
  if layout.strategy == "ring":
    steps = [_ring_bases(layout, length, t) for t in range(layout.shards)]
    chunk = length // layout.shards // len(steps[0])
    kernels = [[[make(_splash_mask((length, chunk), w, order - base), shrink=False) for base in bases] for bases in steps] for w in windows]
  else:
    kernels = [make(_splash_mask((length, length), w, order)) for w in windows]
  kernel_specs = jax.tree.map(
    lambda kern: kern.manual_sharding_spec(NamedSharding(mesh, PartitionSpec(head_axes, CONTEXT_AXIS))),
    kernels,
    is_leaf=lambda x: isinstance(x, kernel_lib.SplashAttentionKernel),
  )
  qh = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)  # [B,H,S,D]: splash does not scale
  kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  head_major = lambda spec: PartitionSpec(spec[0], spec[2], spec[1], spec[3])  # noqa: E731
  restore = np.argsort(order)

  def gathered(kernel, q, k, v, seg, sinks):
    gather = functools.partial(jax.lax.all_gather, axis_name=CONTEXT_AXIS, tiled=True)
    k, v, kv_seg = gather(k, axis=2), gather(v, axis=2), gather(seg, axis=1)
    if layout.load_balance:  # back to natural order: the mask indexes keys by position
      k, v, kv_seg = jnp.take(k, restore, axis=2), jnp.take(v, restore, axis=2), jnp.take(kv_seg, restore, axis=1)
    one = lambda q1, k1, v1, s1, kv1: kernel(q1, k1, v1, segment_ids=kernel_lib.SegmentIds(q=s1, kv=kv1), sinks=sinks)  # noqa: E731
    return jax.vmap(one)(q, k, v, seg, kv_seg)

  def ring(kernel_steps, q, k, v, seg, sinks):
    return _splash_ring(kernel_steps, q, k, v, seg, sinks, layout.shards)

  run = ring if layout.strategy == "ring" else gathered
  w_index = jnp.int32(0) if isinstance(window, int) else sum(jnp.where(jnp.asarray(window) == w, i, 0) for i, w in enumerate(windows))

  def local(kernels, q, k, v, seg, sinks, index):
    if len(kernels) == 1:
      return run(kernels[0], q, k, v, seg, sinks)
    return jax.lax.switch(index, [functools.partial(run, kern) for kern in kernels], q, k, v, seg, sinks)

  fn = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(kernel_specs, head_major(qs), head_major(kvs), head_major(kvs), rows, sink_spec, PartitionSpec()),
    out_specs=head_major(qs),
    check_vma=False,
  )
  return jnp.swapaxes(fn(kernels, qh, kh, vh, segments, sinks, w_index), 1, 2)


def _splash_block(kernel, q, k, v, seg, kv_seg):
  """One ring block with splash's forward: (output [B,H,S,Dv] float32, log-sum-exp [B,H,S]); rows that see no key of
  the block get output 0 and a log-sum-exp far below any real one."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

  kw = {k_: v_ for k_, v_ in kernel.kwargs.items() if k_ != "save_residuals"}

  def one(q1, k1, v1, s1, kv1):
    out, (lse,) = kernel_lib._splash_attention_forward(kernel.fwd_mask_info, q1, k1, v1, kernel_lib.SegmentIds(q=s1, kv=kv1), None, save_residuals=True, **kw)
    return out, lse

  out, lse = jax.vmap(one)(q, k, v, seg, kv_seg)
  seen = jnp.isfinite(lse) & (lse > 0.5 * kw["mask_value"])
  return jnp.where(seen[..., None], out.astype(jnp.float32), 0.0), jnp.where(seen, lse, 0.5 * kw["mask_value"])


def _splash_block_grads(kernel, q, k, v, seg, kv_seg, out, lse, g):
  """dq, dk, dv of one ring block's share of the merged attention (splash's backward kernels, given the merged
  output and log-sum-exp)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib

  kw = kernel.kwargs

  def one(q1, k1, v1, s1, kv1, o1, l1, g1):
    segments = kernel_lib.SegmentIds(q=s1, kv=kv1)
    res = (q1, k1, v1, segments, None, o1, l1, kernel.dq_mask_info, kernel.dkv_mask_info)
    grads = kernel_lib._splash_attention_bwd(
      False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"], res, g1
    )
    return grads[3:6]

  return jax.vmap(one)(q, k, v, seg, kv_seg, out, lse, g)


def _halves(x, parts: int, axis: int):
  return jnp.split(x, parts, axis=axis) if parts > 1 else [x]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _splash_ring(kernel_steps, q, k, v, seg, sinks, shards):
  return _splash_ring_forward(kernel_steps, q, k, v, seg, sinks, shards)[0]


def _splash_ring_forward(kernel_steps, q, k, v, seg, sinks, shards):
  """q [B,H,s,D] (scaled), k/v [B,K,s,D], seg [B,s] local, sinks [H] or None; kernel_steps[t][c]: step t's kernel for
  key chunk c. The sinks join the merge as one more block of one logit and no value."""
  out = lse = None
  blocks = (k, v, seg)
  for t in range(shards):
    incoming = jax.tree.map(lambda x: _rotate(x, shards), blocks) if t < shards - 1 else None
    parts = len(kernel_steps[t])
    for kernel, kb, vb, sb in zip(kernel_steps[t], _halves(blocks[0], parts, 2), _halves(blocks[1], parts, 2), _halves(blocks[2], parts, 1), strict=True):
      out_t, lse_t = _splash_block(kernel, q, kb, vb, seg, sb)
      out, lse = (out_t, lse_t) if out is None else _merge(out, lse, out_t, lse_t)
    blocks = incoming
  if sinks is not None:
    out, lse = _merge(out, lse, 0.0, jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], lse.shape))
  result = out.astype(q.dtype)
  return result, (kernel_steps, q, k, v, seg, sinks, result, lse)


def _splash_ring_backward(shards, residuals, g):
  kernel_steps, q, k, v, seg, sinks, out, lse = residuals
  dq = jnp.zeros(q.shape, jnp.float32)
  dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  blocks = (k, v, seg)
  for t in range(shards):
    incoming = jax.tree.map(lambda x: _rotate(x, shards), blocks) if t < shards - 1 else None
    parts = len(kernel_steps[t])
    dks, dvs = [], []
    for kernel, kb, vb, sb in zip(kernel_steps[t], _halves(blocks[0], parts, 2), _halves(blocks[1], parts, 2), _halves(blocks[2], parts, 1), strict=True):
      dq_t, dk_t, dv_t = _splash_block_grads(kernel, q, kb, vb, seg, sb, out, lse, g)
      dq = dq + dq_t.astype(jnp.float32)
      dks.append(dk_t.astype(jnp.float32))
      dvs.append(dv_t.astype(jnp.float32))
    dk, dv = _rotate(dk + jnp.concatenate(dks, axis=2), shards), _rotate(dv + jnp.concatenate(dvs, axis=2), shards)
    blocks = incoming
  dsinks = None
  if sinks is not None:  # d out / d sink = -p_sink out, p_sink = exp(sink - lse)
    delta = jnp.sum(g.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,H,s]
    dsinks = -jnp.sum(jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse) * delta, axis=(0, 2)).astype(sinks.dtype)
  return None, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks


_splash_ring.defvjp(_splash_ring_forward, _splash_ring_backward)
