"""Moving routed rows between orders and devices, for the MoE dispatch (maxtext.layers.moe_dispatch).

- Permutations whose backward passes are gathers too (`permute`, `take_pairs`): the inverse order is known, so no
  scatter-add is needed.
- The ragged exchange (`exchange`): rows grouped by expert go to the devices owning their experts with one
  `ragged_all_to_all`, and return the same way; XLA:CPU, which has no ragged all-to-all, runs it as a padded
  `all_to_all` (`native=False`). A receive buffer smaller than the worst case (MaxText's `ragged_buffer_factor`)
  keeps, on each receiving device, its sources' rows in (source device, local expert) order until the buffer is full
  (`truncate`); the rest are not sent and come back as zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

Axes = tuple[str, ...]

# ---------------------------------------------------------------------------------------------------------------
# Permutations with gather backward passes


def _permute_impl(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
  return x[perm]


@jax.custom_vjp
def permute(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
  """x[perm] for a permutation perm whose inverse is `inverse`; the gradient is g[inverse] (a gather, not a scatter-add)."""
  return _permute_impl(x, perm, inverse)


permute.defvjp(lambda x, perm, inverse: (x[perm], inverse), lambda inverse, g: (g[inverse], None, None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def take_pairs(tokens: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
  """tokens [T, d] -> rows [T·k, d] in pair order `order` (pair p is token p // k; `inverse` undoes order); the
  gradient puts the rows back in pair order and sums each token's k rows (gathers, no scatter-add)."""
  return tokens[order // k]


def _take_pairs_fwd(tokens, order, inverse, k):
  return tokens[order // k], inverse


def _take_pairs_bwd(k, inverse, g):
  per_pair = g[inverse].reshape(-1, k, g.shape[-1])
  return jnp.sum(per_pair, axis=1, dtype=jnp.float32).astype(g.dtype), None, None


take_pairs.defvjp(_take_pairs_fwd, _take_pairs_bwd)


# ---------------------------------------------------------------------------------------------------------------
# The ragged exchange


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def ragged_all_to_all(
  operand: jax.Array,
  output: jax.Array,
  input_offsets: jax.Array,
  send_sizes: jax.Array,
  output_offsets: jax.Array,
  recv_sizes: jax.Array,
  axes: Axes,
  native: bool,
) -> jax.Array:
  """jax.lax.ragged_all_to_all, or (native=False, for XLA:CPU) the same exchange through a padded all_to_all:
  every slice travels in a buffer as long as the operand, and is written at its offset on arrival."""
  if native:
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axes)
  n = operand.shape[0]
  rows = jnp.arange(n)
  source = jnp.minimum(input_offsets[:, None] + rows, n - 1)  # [slices, n]
  chunks = jnp.where((rows < send_sizes[:, None])[..., None], operand[source], 0)
  chunks = jax.lax.all_to_all(chunks, axes, 0, 0, tiled=True)  # slice i now comes from device i // (slices / devices)
  offsets = jax.lax.all_to_all(output_offsets, axes, 0, 0, tiled=True)
  target = jnp.where(rows < recv_sizes[:, None], offsets[:, None] + rows, output.shape[0])  # out of range: dropped
  return output.at[target.reshape(-1)].set(chunks.reshape(-1, *operand.shape[1:]), mode="drop")


def truncate(by_dest: jax.Array, buffer_rows: int) -> jax.Array:
  """Rows each source may send each destination's local experts [source, destination, local] so that no destination
  receives more than buffer_rows: per destination, the (source, local expert) groups in that order are kept until
  the buffer is full (MaxText's ragged_buffer_factor truncation); a group that crosses the end keeps its first rows."""
  ep, _, local = by_dest.shape
  flat = jnp.swapaxes(by_dest, 0, 1).reshape(ep, ep * local)  # [destination, source x local]
  ends = jnp.minimum(jnp.cumsum(flat, axis=1), buffer_rows)
  kept = ends - jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], axis=1)
  return jnp.swapaxes(kept.reshape(ep, ep, local), 0, 1)


class Exchanged(NamedTuple):
  """What `exchange` returns."""

  received: jax.Array  # [buffer_rows, d]: the rows this device's experts run on, grouped by local expert
  sizes: jax.Array  # [E/ep] int32: the group sizes of received
  sent: jax.Array  # [E] int32: how many of each expert's rows (its first ones) were sent; the rest are dropped
  back: Callable[[jax.Array], jax.Array]  # the owner's outputs in received's layout -> the senders' row order (dropped rows zero)


def exchange(rows: jax.Array, counts: jax.Array, buffer_rows: int, axes: Axes, ep: int, native: bool, limit: int = 0) -> Exchanged:
  """Send rows (grouped by expert, counts [E]) to the devices owning their experts (split evenly over the ep devices
  of axes) into receive buffers of buffer_rows. limit > 0: a device receives at most limit rows (`truncate`); the
  others stay home. Without it, buffer_rows must hold the worst case."""
  e = counts.shape[0]
  local = e // ep
  me = jax.lax.axis_index(axes)
  every = jax.lax.all_gather(counts, axes)  # [source, E]
  sender_offsets = _exclusive_cumsum(every, axis=1)  # where each expert's rows start in each sender's rows
  by_dest = every.reshape(ep, ep, local)  # [source, destination, local expert]
  if limit:
    by_dest = truncate(by_dest, limit)
  sent = by_dest[me].reshape(e)
  totals = jnp.sum(by_dest, axis=0)  # [destination, local expert]
  group_start = _exclusive_cumsum(totals, axis=1)
  before = _exclusive_cumsum(by_dest, axis=0)  # rows from earlier sources
  to_offsets = (group_start + before[me]).reshape(e)
  from_sizes = jax.lax.dynamic_index_in_dim(by_dest, me, axis=1, keepdims=False).reshape(e)  # [source x local]
  out = jnp.zeros((buffer_rows, *rows.shape[1:]), rows.dtype)
  received = ragged_all_to_all(rows, out, sender_offsets[me], sent, to_offsets, from_sizes, axes, native)

  def back(results: jax.Array) -> jax.Array:
    mine = jax.lax.dynamic_index_in_dim(before, me, axis=1, keepdims=False)  # [source, local]
    offsets = (group_start[me][None, :] + mine).reshape(e)
    to_sender = jax.lax.dynamic_index_in_dim(sender_offsets.reshape(ep, ep, local), me, axis=1, keepdims=False).reshape(e)
    home = jnp.zeros((rows.shape[0], *results.shape[1:]), results.dtype)
    return ragged_all_to_all(results, home, offsets, from_sizes, to_sender, sent, axes, native)

  return Exchanged(received, totals[me], sent, back)
