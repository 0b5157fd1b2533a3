"""Moving routed rows between orders and devices, for the MoE dispatch (maxtext.layers.moe_dispatch).

- Permutations whose backward passes are gathers too (`permute`, `take_pairs`): the inverse order is known, so no
  scatter-add is needed.
- The ragged exchange (`exchange`): rows grouped by expert go to the devices owning their experts with one
  `ragged_all_to_all`, and return the same way; XLA:CPU, which has no ragged all-to-all, runs it as a padded
  `all_to_all` (`native=False`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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


def exchange(
  rows: jax.Array, counts: jax.Array, buffer_rows: int, axes: Axes, ep: int, native: bool
) -> tuple[jax.Array, jax.Array, Callable[[jax.Array], jax.Array]]:
  """Send rows (grouped by expert, counts [E]) to the devices owning their experts (split evenly over the ep devices
  of axes).

  Returns (received rows [buffer_rows, d] grouped by local expert, local group sizes [E/ep], the return trip that
  takes the owner's outputs in that layout back to the senders' row order).
  """
  e = counts.shape[0]
  local = e // ep
  me = jax.lax.axis_index(axes)
  every = jax.lax.all_gather(counts, axes)  # [source, E]
  by_dest = every.reshape(ep, ep, local)  # [source, destination, local expert]
  totals = jnp.sum(by_dest, axis=0)  # [destination, local expert]
  group_start = _exclusive_cumsum(totals, axis=1)
  before = _exclusive_cumsum(by_dest, axis=0)  # rows from earlier sources
  send_offsets = _exclusive_cumsum(counts)
  to_offsets = (group_start + before[me]).reshape(e)
  from_sizes = jax.lax.dynamic_index_in_dim(by_dest, me, axis=1, keepdims=False).reshape(e)  # [source x local]
  out = jnp.zeros((buffer_rows, *rows.shape[1:]), rows.dtype)
  received = ragged_all_to_all(rows, out, send_offsets, counts, to_offsets, from_sizes, axes, native)

  def back(results: jax.Array) -> jax.Array:
    mine = jax.lax.dynamic_index_in_dim(before, me, axis=1, keepdims=False)  # [source, local]
    offsets = (group_start[me][None, :] + mine).reshape(e)
    senders = _exclusive_cumsum(every, axis=1).reshape(ep, ep, local)
    to_sender = jax.lax.dynamic_index_in_dim(senders, me, axis=1, keepdims=False).reshape(e)
    home = jnp.zeros((rows.shape[0], *results.shape[1:]), results.dtype)
    return ragged_all_to_all(results, home, offsets, from_sizes, to_sender, counts, axes, native)

  return received, totals[me], back
