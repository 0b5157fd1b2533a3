"""How routed tokens reach their experts and come back: per-device dispatch inside one shard_map.

Every device dispatches its own tokens (`activation_batch` x `activation_length` shard) and runs the expert
weights gathered over every mesh axis except the expert axis; nothing of the global batch is materialised on one
device. With T tokens on a device, k experts per token, E experts and width d:

- **sparse** (`sparse_matmul=true`): the T·k (token, expert) pairs are sorted by expert, the tokens gathered in
  that order ([T·k, d], no k-fold copy beforehand), the experts run as grouped matmuls (maxtext.layers.grouped_matmul:
  `megablox`, `tokamax` or `ragged_dot`), and the outputs are gathered back to (token, choice) order and summed with
  the routing weights in float32. Both gathers have gather backward passes (custom VJPs of the permutation,
  maxtext.layers.expert_exchange).
- **dense** (`sparse_matmul=false`): experts run as one batched matmul over [E, slots, d] buffers: without
  capacity and expert parallelism, every expert over every token (E/k times the FLOPs of the routed pairs),
  combined with a [T, E] weight matrix that is zero off the chosen experts; otherwise the chosen pairs are
  scattered into per-expert slots.

Capacity (`capacity_factor` > 0) is per sequence: expert e takes at most C = ceil(capacity_factor · S · k / E)
of a sequence's pairs, earlier tokens first (a token's k choices in order), counted across sequence shards.
Dropped pairs are sorted past the last expert (sparse) or get no slot (dense), add nothing, and are counted.

Expert parallelism: when the expert weights are split over mesh axes that also split the tokens (`expert`),
the sparse path sends each expert's rows to the device owning it with one `ragged_all_to_all` (no padding to a
capacity: a device receives at most ep · T · min(k, E/ep) rows, fewer with capacity), the owner runs its experts on
rows that arrive already grouped by expert, and a second `ragged_all_to_all` returns them. MaxText's
`ragged_buffer_factor` > 0 bounds that receive buffer by int(T·k · factor) rows (T·k: what a device receives when
the load is balanced); on each receiving device, rows past it in (source device, local expert) order are not sent,
add nothing, and are counted as dropped (maxtext.layers.expert_exchange.truncate). XLA:CPU has no
ragged-all-to-all; there (the platform policy's `ragged_all_to_all=False`) the same exchange runs as a padded
`all_to_all`. The dense path exchanges [E, slots] buffers with `all_to_all` (slots = the device's tokens when
dropless).

Weights enter the shard_map as stored (float32, sharded); each expert matmul gathers its weight in the compute
dtype, and its weight gradient (float32 accumulation, written in the compute dtype) is summed over the devices that
shared the weight and reduce-scattered back to the stored sharding (`expert_matmul`).

Chunks (`expert_chunks` > 1, sparse paths): a device runs its experts in equal chunks, one after the other, so that
only one chunk's gathered weights (and their unreduced gradients) are live (`_chunked_grouped_mlp`).

Quantization (the plan's recipe): every expert matmul is qwix's quantized product (maxtext.layers.quantization.
expert_product: per-expert scales, grouped or batched) on the gathered weight, or on the gathered stored
values and scales of a frozen quantized base (QLoRA, decoding), which take no gradient. Grouped matmuls then run
as XLA's ragged dot: megablox and tokamax take no quantized operands, so the platform policy resolves their paths
to `ragged_dot` when `quantization` is set (maxtext.platform.moe_dispatch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtext.layers import grouped_matmul as gmm
from maxtext.layers import quantization
from maxtext.layers.dtypes import cast
from maxtext.layers.expert_exchange import exchange, permute, take_pairs
from maxtext.layers.matmul import product

P = jax.sharding.PartitionSpec
Axes = tuple[str, ...]


class ExpertWeights(NamedTuple):
  """Stacked expert weights, [E, emb, mlp] for wi_0/wi_1 and [E, mlp, emb] for wo (the local experts inside the
  dispatch), with mlp_bias their per-expert biases, [E, mlp] and [E, emb], and for a stored quantized base the
  weights' scales ([E, 1 or groups, out]: maxtext.layers.quantization.expert_weight)."""

  wi_0: jax.Array
  wi_1: jax.Array
  wo: jax.Array
  wi_0_bias: jax.Array | None = None
  wi_1_bias: jax.Array | None = None
  wo_bias: jax.Array | None = None
  wi_0_scale: jax.Array | None = None
  wi_1_scale: jax.Array | None = None
  wo_scale: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about one MoE layer's dispatch (hashable)."""

  num_experts: int
  k: int
  sparse: bool  # grouped matmuls over sorted pairs; False: batched over [E, slots] buffers
  kernel: gmm.Kernel
  wi_tiles: gmm.Tiles
  wo_tiles: gmm.Tiles
  capacity: int  # slots per expert per sequence; 0: dropless
  activations: tuple[str, ...]  # mlp_activations: act0(x wi_0) * act1(x wi_1)
  dtype: Any  # compute dtype
  glu_limit: float = 0.0  # > 0: a clamped SwiGLU (maxtext.layers.mlp.glu): gpt-oss's, or with glu_clamp_only DeepSeek V4's
  glu_clamp_only: bool = False
  integer_rounding: bool = False  # float32 -> bfloat16 by integer ops (CPU policy)
  ragged_all_to_all: bool = True  # False: the exchange runs as a padded all_to_all (XLA:CPU)
  quantization: quantization.Recipe | None = None  # quantized expert products (the platform policy's recipe)
  ragged_buffer_factor: float = -1.0  # > 0: expert parallelism receives at most int(T·k · factor) rows per device (drops the rest)
  expert_chunks: int = 1  # > 1: the grouped MLP runs over this many chunks of the (local) experts, one chunk's weights gathered at a time


@dataclasses.dataclass(frozen=True)
class Layout:
  """Which mesh axes split the tokens and the weights inside the shard_map."""

  batch: Axes = ()  # split the batch dimension of the tokens
  length: Axes = ()  # split the sequence dimension
  experts: Axes = ()  # split the experts and exchange tokens (expert parallelism); () -> every device has all experts
  wi: tuple[Axes, Axes, Axes] = ((), (), ())  # stored sharding of wi_0/wi_1 [E, emb, mlp]
  wo: tuple[Axes, Axes, Axes] = ((), (), ())  # stored sharding of wo [E, mlp, emb]
  wi_bias: tuple[Axes, Axes] = ((), ())  # stored sharding of wi_0_bias/wi_1_bias [E, mlp]
  wo_bias: tuple[Axes, Axes] = ((), ())  # stored sharding of wo_bias [E, emb]
  wi_scale: tuple[Axes, Axes, Axes] = ((), (), ())  # stored sharding of wi_0_scale/wi_1_scale (as wi's on the expert and mlp axes)
  wo_scale: tuple[Axes, Axes, Axes] = ((), (), ())  # stored sharding of wo_scale (as wo's on the expert and embed axes)
  sizes: tuple[tuple[str, int], ...] = ()  # mesh axis sizes

  @property
  def tokens(self) -> Axes:
    return self.batch + self.length

  def size(self, axes: Axes) -> int:
    table = dict(self.sizes)
    return math.prod(table[a] for a in axes)


# ---------------------------------------------------------------------------------------------------------------
# Expert matmuls: gathered weights, float32 weight gradients


@dataclasses.dataclass(frozen=True)
class Batched:
  """An einsum "x,w->y" (float32 accumulation); its gradients are the two transposed einsums."""

  spec: str

  def fwd(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array | None, out_dtype: Any) -> jax.Array:
    del group_sizes, out_dtype
    return product(self.spec, x, w)

  def dx(self, g: jax.Array, w: jax.Array, group_sizes: jax.Array | None, out_dtype: Any) -> jax.Array:
    del group_sizes, out_dtype
    x, w_, y = _spec_parts(self.spec)
    return product(f"{y},{w_}->{x}", g, w)

  def dw(self, x: jax.Array, g: jax.Array, group_sizes: jax.Array | None, out_dtype: Any) -> jax.Array:
    del group_sizes
    x_, w, y = _spec_parts(self.spec)
    return product(f"{x_},{y}->{w}", x, g).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class Grouped:
  """A grouped matmul rows [m, k] x weights [E, k, n] (maxtext.layers.grouped_matmul) with its blocks."""

  kernel: gmm.Kernel
  tiles: gmm.Tiles

  def fwd(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array, out_dtype: Any) -> jax.Array:
    return self.kernel.fwd(x, w, group_sizes, self.tiles.fwd, self._out(out_dtype))

  def dx(self, g: jax.Array, w: jax.Array, group_sizes: jax.Array, out_dtype: Any) -> jax.Array:
    return self.kernel.dlhs(g, w, group_sizes, self.tiles.dlhs, self._out(out_dtype))

  def dw(self, x: jax.Array, g: jax.Array, group_sizes: jax.Array, out_dtype: Any) -> jax.Array:
    return self.kernel.drhs(x, g, group_sizes, self.tiles.drhs, out_dtype)

  def _out(self, dtype: Any) -> Any:
    # megablox writes the compute dtype from its float32 accumulator; XLA fuses the cast of a float32 result.
    return dtype if self.kernel.name == "megablox" else jnp.float32


def _spec_parts(spec: str) -> tuple[str, str, str]:
  inputs, out = spec.split("->")
  x, w = inputs.split(",")
  return x, w, out


def expert_matmul(
  x: jax.Array,
  w: jax.Array,
  scale: jax.Array | None,
  group_sizes: jax.Array | None,
  op: Batched | Grouped,
  stored: tuple[Axes, ...],
  scale_stored: tuple[Axes, ...],
  plan: Plan,
) -> jax.Array:
  """x times the expert weight w, which arrives as stored (sharded `stored` per dimension, beyond the expert axes).

  Forward: w is cast to the compute dtype, then gathered over its sharded dimensions (minor axis first). Backward:
  the weight gradient is accumulated in float32 over this device's rows, written in the compute dtype (as MaxText's
  megablox gmm does: half the memory of the layer's unsharded gradient, and megablox's float32 weight-gradient block
  would not fit its 16 MiB of scoped VMEM at the default tiles), reduce-scattered over each gathered dimension (major
  axis first), then returned in the weight's dtype. The shard_map (check_vma=False) sums it over the token axes that
  do not split the weight. Returns plan.dtype.

  With plan.quantization the product is maxtext.layers.quantization.expert_product on the gathered weight (its
  gradient, qwix's, reduce-scattered by the gather's transpose); a stored quantized weight comes with its scale
  (sharded `scale_stored`), and both are gathered as they are and take no gradient (a frozen base).
  """
  dt = plan.dtype
  if plan.quantization is not None:
    if scale is not None:
      w, scale = gather(jax.lax.stop_gradient(w), stored), gather(jax.lax.stop_gradient(scale), scale_stored)
    else:
      w = gather(w.astype(dt), stored)
    spec = op.spec if isinstance(op, Batched) else None
    return quantization.expert_product(x, w, scale, plan.quantization, dt, group_sizes, spec)

  def reduce(dw: jax.Array) -> jax.Array:
    for dim, axes in reversed(list(enumerate(stored))):
      for axis in axes:
        dw = jax.lax.psum_scatter(dw, axis, scatter_dimension=dim, tiled=True)
    return dw

  def forward(x, w, group_sizes):
    x_c, w_c = x.astype(dt), gather(w.astype(dt), stored)
    return cast(op.fwd(x_c, w_c, group_sizes, dt), dt, plan.integer_rounding), (x_c, w_c, group_sizes)

  def backward(residuals, g):
    x_c, w_c, group_sizes = residuals
    g = g.astype(dt)
    dx = cast(op.dx(g, w_c, group_sizes, x.dtype), x.dtype, plan.integer_rounding)
    return dx, reduce(op.dw(x_c, g, group_sizes, dt)).astype(w.dtype), None

  fn = jax.custom_vjp(lambda x, w, group_sizes: forward(x, w, group_sizes)[0])
  fn.defvjp(forward, backward)
  return fn(x, w, group_sizes)


def gather(w: jax.Array, stored: tuple[Axes, ...]) -> jax.Array:
  """w gathered over the mesh axes that split each of its dimensions (minor axis first)."""
  for dim, axes in enumerate(stored):
    for axis in reversed(axes):
      w = jax.lax.all_gather(w, axis, axis=dim, tiled=True)
  return w


Matmul = Callable[[jax.Array, jax.Array, jax.Array | None, str], jax.Array]  # (rows, stored kernel, its scale, 'wi' | 'wo') -> projected rows
BiasRows = Callable[[jax.Array, str], jax.Array]  # (stored bias [E, out], 'wi' | 'wo') -> a bias per row, broadcastable


def expert_mlp(x: jax.Array, w: ExpertWeights, matmul: Matmul, bias_rows: BiasRows, plan: Plan) -> jax.Array:
  """The experts' gated MLP on rows x: wo(glu(x wi_0 + b_0, x wi_1 + b_1)) + b_o (biases with mlp_bias; glu is
  maxtext.layers.mlp.glu). matmul applies one projection to each row with its own expert's kernel (grouped or batched;
  with a stored quantized kernel's scale), bias_rows gives each row its own expert's bias. Every expert projection of
  every dispatch path is made here."""
  from maxtext.layers.mlp import glu  # moe_dispatch is imported by maxtext.layers.moe, which imports mlp

  def project(h: jax.Array, name: str, which: str) -> jax.Array:
    bias = getattr(w, name + "_bias")
    y = matmul(h, getattr(w, name), getattr(w, name + quantization.SCALE_SUFFIX), which)
    return y if bias is None else y + bias_rows(bias.astype(y.dtype), which)

  h0 = checkpoint_name(project(x, "wi_0", "wi"), "mlpwi_0")
  h1 = checkpoint_name(project(x, "wi_1", "wi"), "mlpwi_1")
  return project(glu(plan.activations, plan.glu_limit, plan.glu_clamp_only)(h0, h1), "wo", "wo")


# ---------------------------------------------------------------------------------------------------------------
# Capacity


def sequence_positions(experts: jax.Array, num_experts: int, length_axes: Axes = ()) -> jax.Array:
  """experts [..., S, k] -> each pair's arrival index at its expert within its sequence, earlier tokens first
  (a token's k picks in order); with the sequence split over length_axes, earlier shards' pairs count first."""
  *lead, s, k = experts.shape
  one_hot = jax.nn.one_hot(experts.reshape(*lead, s * k), num_experts, dtype=jnp.int32)  # [..., S·k, E]
  before = jnp.cumsum(one_hot, axis=-2) - one_hot
  positions = jnp.sum(before * one_hot, axis=-1).reshape(experts.shape)
  if length_axes:
    counts = jnp.sum(one_hot, axis=-2)  # [..., E]
    every = jax.lax.all_gather(counts, length_axes)  # [shards, ..., E]
    earlier = jnp.arange(every.shape[0]) < jax.lax.axis_index(length_axes)
    offset = jnp.sum(jnp.where(earlier.reshape(-1, *([1] * counts.ndim)), every, 0), axis=0)  # [..., E]
    positions = positions + jnp.take_along_axis(offset, experts.reshape(*lead, s * k), axis=-1).reshape(experts.shape)
  return positions


# ---------------------------------------------------------------------------------------------------------------
# The per-device dispatch


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
  return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _row_count(rows: int, plan: Plan) -> int:
  """Rows the grouped kernel runs on: megablox needs a multiple of its row tiles."""
  if plan.kernel.name != "megablox":
    return rows
  return max(plan.wi_tiles.padded_rows(rows), plan.wo_tiles.padded_rows(rows))


class SortedPairs(NamedTuple):
  """A device's (token, choice) pairs sorted by expert; dropped pairs (capacity) sort past the last expert."""

  order: jax.Array  # [T·k]: the pair at each sorted position (pair p is token p // k, choice p % k)
  inverse: jax.Array  # [T·k]: the sorted position of each pair
  counts: jax.Array  # [E] int32: kept pairs per expert


def sort_pairs(experts: jax.Array, kept: jax.Array | None, num_experts: int) -> SortedPairs:
  """experts [T, k] (and kept [T, k] with capacity) -> the pairs sorted by expert, stably (earlier tokens first)."""
  key = (experts if kept is None else jnp.where(kept, experts, num_experts)).reshape(-1)
  order = jnp.argsort(key, stable=True)
  return SortedPairs(order, jnp.argsort(order), jnp.bincount(key, length=num_experts).astype(jnp.int32))


def combine_sorted(out: jax.Array, pairs: SortedPairs, weights: jax.Array, kept: jax.Array | None) -> jax.Array:
  """Expert outputs in sorted order [T·k, d] -> the routing-weighted sum per token [T, d], float32."""
  t, k = weights.shape
  per_choice = permute(out, pairs.inverse, pairs.order).reshape(t, k, -1)
  if kept is not None:
    weights = jnp.where(kept, weights, 0.0)
  return jnp.einsum("tkd,tk->td", per_choice, weights, preferred_element_type=jnp.float32)


def receive_rows(tokens: int, layout: Layout, plan: Plan, rows_per_sequence: int) -> tuple[int, int]:
  """(rows of a device's expert-parallel receive buffer, the truncation limit or 0 when the buffer holds the worst case).

  The worst case: every pair of the ep devices lands on this device's experts, ep · T · min(k, E/ep) rows (fewer
  with capacity). ragged_buffer_factor > 0 bounds it by int(T·k · factor), MaxText's balanced size times the factor."""
  k, e, ep = plan.k, plan.num_experts, layout.size(layout.experts)
  bound = ep * tokens * min(k, e // ep)
  if plan.capacity:
    bound = min(bound, ep * (tokens // rows_per_sequence) * plan.capacity * (e // ep))
  if plan.ragged_buffer_factor > 0:
    limit = max(1, int(tokens * k * plan.ragged_buffer_factor))
    if limit < bound:
      return limit, limit
  return bound, 0


def _sparse(tokens, experts, weights, kept, w: ExpertWeights, layout: Layout, plan: Plan, rows_per_sequence: int) -> tuple[jax.Array, jax.Array | None]:
  """Sorted pairs, grouped matmuls, gathered back: tokens [T, d] -> (y [T, d] float32, the pairs [T, k] dropped for
  want of receive buffer (ragged_buffer_factor), or None when none can be)."""
  t, k = experts.shape
  e = plan.num_experts
  pairs = sort_pairs(experts, kept, e)
  rows = take_pairs(tokens, pairs.order, pairs.inverse, k)
  if layout.experts:
    bound, limit = receive_rows(t, layout, plan, rows_per_sequence)
    sent = exchange(rows, pairs.counts, _row_count(bound, plan), layout.experts, layout.size(layout.experts), plan.ragged_all_to_all, limit)
    out = sent.back(_grouped_mlp(sent.received, sent.sizes, w, layout, plan))
    if limit:  # sorted row r is row r - start of its expert's group; rows past what was sent stayed home
      expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(pairs.counts), jnp.arange(t * k), side="right"), e - 1)
      start = jnp.cumsum(pairs.counts) - pairs.counts
      home = (jnp.arange(t * k) - start[expert] >= sent.sent[expert]) & (jnp.arange(t * k) < jnp.sum(pairs.counts))
      return combine_sorted(out, pairs, weights, kept), home[pairs.inverse].reshape(t, k)
  else:
    if kept is not None:  # rows of dropped pairs belong to no group: a kernel may leave them unwritten, both ways
      grouped = (jnp.arange(t * k) < jnp.sum(pairs.counts))[:, None]
      rows = jnp.where(grouped, rows, 0)
    out = _grouped_mlp(_pad_rows(rows, _row_count(t * k, plan)), pairs.counts, w, layout, plan)[: t * k]
    if kept is not None:
      out = jnp.where(grouped, out, 0)
  return combine_sorted(out, pairs, weights, kept), None


def _grouped_mlp(rows: jax.Array, group_sizes: jax.Array, w: ExpertWeights, layout: Layout, plan: Plan) -> jax.Array:
  if plan.expert_chunks > 1:
    return _chunked_grouped_mlp(rows, group_sizes, w, layout, plan)
  tiles = {"wi": plan.wi_tiles, "wo": plan.wo_tiles}
  stored = gathered(layout)

  def matmul(x: jax.Array, weight: jax.Array, scale: jax.Array | None, which: str) -> jax.Array:
    return expert_matmul(x, weight, scale, group_sizes, Grouped(plan.kernel, tiles[which]), stored[which], stored[which + "_scale"], plan)

  ends = jnp.cumsum(group_sizes)
  group = jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right")  # each row's expert; len(group_sizes) past them

  def bias_rows(bias: jax.Array, which: str) -> jax.Array:
    per_row = gather(bias, stored[which + "_bias"])[jnp.minimum(group, group_sizes.shape[0] - 1)]
    # rows past the groups hold whatever the kernel left there: zero bias and no gradient from them
    return jnp.where((group < group_sizes.shape[0])[:, None], per_row, 0)

  return expert_mlp(rows, w, matmul, bias_rows, plan)


def _chunked_grouped_mlp(rows: jax.Array, group_sizes: jax.Array, w: ExpertWeights, layout: Layout, plan: Plan) -> jax.Array:
  """_grouped_mlp over plan.expert_chunks equal chunks of the experts, one after the other (a scan whose body is
  rematerialised): only one chunk's weights are gathered at a time, in both passes. Each chunk's rows, contiguous in
  expert order, are rolled to the front; the other rows are zeroed on the way in and out (a grouped kernel may leave
  rows outside its groups unwritten, both ways)."""
  chunks = plan.expert_chunks
  e = group_sizes.shape[0]
  sizes = group_sizes.reshape(chunks, e // chunks)
  first = (jnp.cumsum(group_sizes) - group_sizes).reshape(chunks, -1)[:, 0]
  arrays = {name: value.reshape(chunks, e // chunks, *value.shape[1:]) for name, value in w._asdict().items() if value is not None}
  index = jnp.arange(rows.shape[0])[:, None]
  one = dataclasses.replace(plan, expert_chunks=1)

  def chunk(total: jax.Array, part: tuple[jax.Array, jax.Array, dict[str, jax.Array]]) -> tuple[jax.Array, None]:
    start, size, weights = part
    inside = index < jnp.sum(size)
    x = jnp.where(inside, jnp.roll(rows, -start, axis=0), 0)
    out = jnp.where(inside, _grouped_mlp(x, size, ExpertWeights(**weights), layout, one), 0)
    return total + jnp.roll(out, start, axis=0), None

  total = jnp.zeros(rows.shape, plan.dtype)
  total, _ = jax.lax.scan(jax.checkpoint(chunk, prevent_cse=False), total, (first, sizes, arrays))
  return total


def gathered(layout: Layout) -> dict[str, tuple[Axes, ...]]:
  """The sharded dimensions the dispatch gathers of each stored expert array ([E, ...]: wi, wo, their `_scale`s and
  `_bias`es): all but the expert dimension when tokens are exchanged (each device runs its own experts), all otherwise."""
  stored = {"wi": layout.wi, "wo": layout.wo, "wi_scale": layout.wi_scale, "wo_scale": layout.wo_scale, "wi_bias": layout.wi_bias, "wo_bias": layout.wo_bias}
  return {name: ((() if layout.experts else axes[0]), *axes[1:]) for name, axes in stored.items()}


def _dense(tokens, experts, weights, positions, w: ExpertWeights, layout: Layout, plan: Plan, rows_per_sequence: int) -> jax.Array:
  """Batched matmuls over [E, slots, d] buffers (or every expert over every token): tokens [T, d] -> y [T, d] float32."""
  e = plan.num_experts
  stored = gathered(layout)

  def batched(specs: dict[str, str]) -> Matmul:
    return lambda x, weight, scale, which: expert_matmul(x, weight, scale, None, Batched(specs[which]), stored[which], stored[which + "_scale"], plan)

  def bias_rows(bias: jax.Array, which: str) -> jax.Array:
    return gather(bias, stored[which + "_bias"])[:, None, :]  # [E, 1, out]: every slot of an expert

  if not plan.capacity and not layout.experts:  # every expert over every token, weighted by zero off the chosen ones
    # The hidden activations stay [T, E, mlp], the wi product's own output order (x times the weights as [d, E·mlp]):
    # produced as [E, T, mlp], that order is a transpose of the product, which XLA:CPU folds into the bf16 wo product
    # after it chose to keep it in bf16, leaving a batched dot neither its bf16 library kernels nor its fallback
    # (Eigen, no bf16) run ("Unsupported element type for DotThunk"); moving the expert axis first for wo is a copy.
    def every_token_bias(bias: jax.Array, which: str) -> jax.Array:
      b = gather(bias, stored[which + "_bias"])
      return b[None] if which == "wi" else b[:, None, :]  # [1, E, mlp] over [T, E, mlp]; [E, 1, emb] over [E, T, emb]

    out = expert_mlp(tokens, w, batched({"wi": "td,edf->tef", "wo": "tef,efd->etd"}), every_token_bias, plan)
    combine = jnp.einsum("tke,tk->te", jax.nn.one_hot(experts, e, dtype=jnp.float32), weights)
    return jnp.einsum("etd,te->td", out, combine, preferred_element_type=jnp.float32)
  slot, slots = expert_slots(experts, positions, rows_per_sequence, plan.capacity, e)
  buffer = pack(tokens, slot, slots, e)
  matmul = batched({"wi": "ecd,edf->ecf", "wo": "ecf,efd->ecd"})
  if layout.experts:
    ep = layout.size(layout.experts)
    local = e // ep
    buffer = jax.lax.all_to_all(buffer, layout.experts, 0, 0, tiled=True)  # [source x local experts, slots, d]
    buffer = buffer.reshape(ep, local, slots, -1).swapaxes(0, 1).reshape(local, ep * slots, -1)
    out = expert_mlp(buffer, w, matmul, bias_rows, plan)
    out = out.reshape(local, ep, slots, -1).swapaxes(0, 1).reshape(e, slots, -1)
    out = jax.lax.all_to_all(out, layout.experts, 0, 0, tiled=True)
  else:
    out = expert_mlp(buffer, w, matmul, bias_rows, plan)
  return unpack_combine(out, slot, weights)


def expert_slots(experts: jax.Array, positions: jax.Array | None, rows_per_sequence: int, capacity: int, num_experts: int) -> tuple[jax.Array, int]:
  """Each pair's slot in [E, slots] buffers -> (slot [T, k], slots per expert); E·slots marks a dropped pair.

  With capacity, each sequence of the device has `capacity` slots per expert, filled by arrival order (positions);
  without, every expert has a slot for every token of the device (dropless, for expert parallelism)."""
  t, _ = experts.shape
  if capacity:
    slots = (t // rows_per_sequence) * capacity
    sequence = jnp.arange(t // rows_per_sequence).repeat(rows_per_sequence)[:, None]
    slot = jnp.where(positions < capacity, experts * slots + sequence * capacity + positions, num_experts * slots)
    return slot, slots
  return experts * t + sequence_positions(experts, num_experts), t


def pack(tokens: jax.Array, slot: jax.Array, slots: int, num_experts: int) -> jax.Array:
  """tokens [T, d] into [E, slots, d] buffers at their pairs' slots (empty slots are zero; dropped pairs go nowhere)."""
  k = slot.shape[-1]
  buffer = jnp.zeros((num_experts * slots + 1, tokens.shape[-1]), tokens.dtype)
  return buffer.at[slot.reshape(-1)].set(jnp.repeat(tokens, k, axis=0))[:-1].reshape(num_experts, slots, -1)


def unpack_combine(out: jax.Array, slot: jax.Array, weights: jax.Array) -> jax.Array:
  """Expert outputs [E, slots, d] -> the routing-weighted sum per token [T, d], float32 (dropped pairs add zero)."""
  flat = jnp.concatenate([out.reshape(-1, out.shape[-1]), jnp.zeros((1, out.shape[-1]), out.dtype)])
  return jnp.einsum("tkd,tk->td", flat[slot], weights, preferred_element_type=jnp.float32)


def local_dispatch(
  x: jax.Array, weights: jax.Array, experts: jax.Array, valid: jax.Array, w: ExpertWeights, layout: Layout, plan: Plan
) -> tuple[jax.Array, jax.Array]:
  """One device's tokens x [b, s, d] with their routing (weights, experts [b, s, k]) -> (y [b, s, d] float32, dropped
  valid pairs summed over the token axes)."""
  b, s, d = x.shape
  k = plan.k
  tokens = x.reshape(b * s, d).astype(plan.dtype)
  experts = experts.reshape(b, s, k)
  positions = kept = None
  dropped = jnp.zeros((), jnp.float32)
  if plan.capacity:
    positions = sequence_positions(experts, plan.num_experts, layout.length).reshape(b * s, k)
    kept = positions < plan.capacity
    dropped = jnp.sum(jnp.where(kept, 0.0, 1.0) * valid.reshape(b * s, 1))
    if layout.tokens:
      dropped = jax.lax.psum(dropped, layout.tokens)
  experts, weights = experts.reshape(b * s, k), weights.reshape(b * s, k)
  if plan.sparse:
    y, home = _sparse(tokens, experts, weights, kept, w, layout, plan, s)
    if home is not None:  # pairs the bounded receive buffer (ragged_buffer_factor) left at home
      dropped = dropped + jax.lax.psum(jnp.sum(jnp.where(home, 1.0, 0.0) * valid.reshape(b * s, 1)), layout.tokens)
  else:
    y = _dense(tokens, experts, weights, positions, w, layout, plan, s)
  return y.reshape(b, s, d), dropped


def dispatch(
  x: jax.Array, weights: jax.Array, experts: jax.Array, valid: jax.Array, w: ExpertWeights, layout: Layout, plan: Plan, mesh: Any
) -> tuple[jax.Array, jax.Array]:
  """local_dispatch on every device's shard of the tokens (shard_map over mesh; mesh None: one device, no collectives)."""
  if mesh is None:
    return local_dispatch(x, weights, experts, valid, w, layout, plan)
  tokens = P(layout.batch or None, layout.length or None)
  spec = lambda axes: P(*(a or None for a in axes))  # noqa: E731
  stored = (layout.wi, layout.wi, layout.wo, layout.wi_bias, layout.wi_bias, layout.wo_bias, layout.wi_scale, layout.wi_scale, layout.wo_scale)
  w_specs = ExpertWeights(*(spec(a) for a in stored))
  fn = jax.shard_map(
    lambda x, weights, experts, valid, w: local_dispatch(x, weights, experts, valid, w, layout, plan),
    mesh=mesh,
    in_specs=(P(*tokens, None), P(*tokens, None), P(*tokens, None), tokens, w_specs),
    out_specs=(P(*tokens, None), P()),
    check_vma=False,  # jax's megablox kernels declare no varying axes; cotangents follow shard_map's unchecked rules
  )
  return fn(x, weights, experts, valid, w)
