"""Causal dot-product attention kernels behind one entry point, `attend`, chosen by the platform policy.

Kernels (docs/models.md says which runs where, and why):
- `xla`: einsums with a materialised [B, K, G, S, T] float32 score tensor; the reference (maxtext.layers.xla_attention).
- `chunked`: the same maths over blocks of keys with an online softmax and a hand-written backward,
  so forward and backward hold O(S x block) scores instead of O(S^2) (CPU, long sequences; maxtext.layers.chunked_attention).
- `splash`: TPU Pallas splash attention (inside jax) with segment ids, causal or local masks, GQA, soft cap.
- `cudnn`: GPU cuDNN fused attention; packed documents through cuDNN's segment offsets when the pipeline
  bounds the documents per row (max_segments_per_seq > 0), else through a boolean segment mask.

Attention sinks (gpt-oss): a learned logit per query head joins every softmax row as one more column with no
value, so each row's weights sum to less than one. The XLA, chunked and splash kernels take them (also under
context parallelism, both strategies); cuDNN cannot, and autoselected then falls back to XLA with a logged reason.

The fused kernels mask by token index within the row: they assume positions count up by one inside each
segment, which is what the data pipeline produces (packed or not). The XLA and chunked kernels mask by positions.
Chunked local attention (Llama 4, a negative window) reaches the fused kernels as causal attention over segment ids
split at the chunk boundaries of the positions (`chunk_segments`), so packed documents chunk from their own start.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from maxtext.errors import ConfigError
from maxtext.layers import context_parallel
from maxtext.layers.chunked_attention import chunked_attention
from maxtext.layers.sharding import logical_to_spec
from maxtext.layers.xla_attention import attention_mask, xla_attention
from maxtext.platform import Policy

KERNELS = ("xla", "chunked", "splash", "cudnn")


class LayerCache(Protocol):
  """What attention layers ask of one layer's decode cache (maxtext.inference.kv_cache.LayerCache has it)."""

  arrays: dict[str, jax.Array]

  def update(self, new: dict[str, jax.Array], rules: Any, window: int = 0) -> tuple[Any, dict[str, jax.Array], jax.Array]: ...

  def attend(
    self, q: jax.Array, k: jax.Array, v: jax.Array, window: int, scale: float, soft_cap: float | None, precision: Any, rules: Any, sinks: Any = None
  ) -> tuple: ...


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
  image_ids: jax.Array | None = None,
) -> jax.Array:
  """Causal attention q [B,S,H,D], k [B,T,K,D], v [B,T,K,Dv] (H a multiple of K) -> [B,S,H,Dv] in q's dtype.

  positions [B,S]/[B,T] int; segment_ids [B,S] (self-attention, 0 = padding) or None; window: attend to keys with
  q_pos - kv_pos < window (0 = unbounded; < 0: within the query's chunk of -window positions, Llama 4), an int or a
  traced scalar taking one of window_choices (scanned layers with mixed windows); soft_cap: cap * tanh(logits / cap) or None; scale multiplies q.k. rules: logical axis
  rules that place the fused kernels' shard_map (batch and heads) under an active mesh. sinks [H]: each head's
  sink logit (None: no sinks). context: the sequence's context-parallel layout; self-attention over a
  `context`-sharded mesh then gathers or rings the keys and values (maxtext.layers.context_parallel). image_ids
  [B, S]: tokens with the same non-zero id (an image's soft tokens, Gemma 3) see each other both ways; the XLA kernel
  runs that mask (the fused kernels are causal).
  """
  kernel = select(policy, dtype=q.dtype, head_dim=q.shape[-1], q_len=q.shape[1], kv_len=k.shape[1], soft_cap=soft_cap, sinks=sinks is not None)
  if context_parallel.is_active(context, q.shape[1], k.shape[1]):  # self-attention: kv_positions are q_positions
    return context_parallel.attend(q, k, v, q_positions, segment_ids, window, context, soft_cap, scale, policy, kernel, precision, window_choices, rules, sinks)
  if image_ids is not None and kernel != "xla":
    _log_once(f"attention: images attend bidirectionally, which the {kernel} kernel does not take; running XLA dot-product attention")
    kernel = "xla"
  if kernel == "xla":
    mask = attention_mask(q_positions, kv_positions, segment_ids, window, image_ids=image_ids)
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
    mask_only = functools.partial(run, max_segments=0) if kernel == "cudnn" else run  # chunks are more runs than documents
    out = _per_window(_chunks_as_segments(run, mask_only), q, k, v, segments, q_positions, sinks, window, window_choices, rules)
  return out[..., :v_dim]


def chunk_segments(segments: jax.Array, positions: jax.Array, chunk: int) -> jax.Array:
  """Segment ids [B, S] that also split every segment into its chunks of `chunk` positions: causal attention within
  them is chunked local attention (Llama 4), so the fused kernels run it with their plain causal mask, packed
  documents chunking from their own first position. Padding (segment 0) keeps ids below every document's."""
  spread = jnp.max(positions) // chunk + 1
  return segments * spread + positions // chunk


def _chunks_as_segments(run, mask_only):
  """run(q, k, v, segments, sinks, window=w) -> the same taking positions after segments; a chunk (w < 0) runs causal
  attention over chunk_segments with mask_only (cuDNN: its segment mask, not the packed offsets)."""

  def with_chunks(q, k, v, segments, positions, sinks, *, window: int):
    if window < 0:
      return mask_only(q, k, v, chunk_segments(segments, positions, -window), sinks, window=0)
    return run(q, k, v, segments, sinks, window=window)

  return with_chunks


def _per_window(run, q, k, v, segments, positions, sinks, window, window_choices, rules) -> jax.Array:
  """run(q, k, v, segments, positions, sinks, window=int) under a batch/head shard_map; a traced window switches
  between window_choices."""

  def local(q, k, v, segments, positions, sinks):
    if isinstance(window, int):
      return run(q, k, v, segments, positions, sinks, window=window)
    choices = sorted(set(window_choices))
    if not choices:
      raise ValueError("a traced window needs window_choices")
    index = sum(jnp.where(window == w, i, 0) for i, w in enumerate(choices))
    return jax.lax.switch(index, [functools.partial(run, window=w) for w in choices], q, k, v, segments, positions, sinks)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or rules is None:
    return local(q, k, v, segments, positions, sinks)
  qs = logical_to_spec(("activation_batch", None, "activation_heads", None), rules, mesh)
  kvs = logical_to_spec(("activation_batch", None, "activation_kv_heads", None), rules, mesh)
  ss = logical_to_spec(("activation_batch", None), rules, mesh)
  hs = None if sinks is None else logical_to_spec(("activation_heads",), rules, mesh)
  if not isinstance(window, int):  # the traced window enters the shard_map replicated
    w_local = jax.shard_map(
      lambda q, k, v, s, p, h, w: _per_window(run, q, k, v, s, p, h, w, window_choices, None),
      mesh=mesh,
      in_specs=(qs, kvs, kvs, ss, ss, hs, jax.sharding.PartitionSpec()),
      out_specs=qs,
      check_vma=False,
    )
    return w_local(q, k, v, segments, positions, sinks, window)
  return jax.shard_map(local, mesh=mesh, in_specs=(qs, kvs, kvs, ss, ss, hs), out_specs=qs, check_vma=False)(q, k, v, segments, positions, sinks)


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
