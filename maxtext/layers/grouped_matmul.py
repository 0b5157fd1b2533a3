"""Grouped matmuls: rows sorted by group (expert) times that group's matrix, and the two products of their gradient.

For lhs [m, k] whose rows are grouped consecutively by `group_sizes` [G] (rows past sum(group_sizes) belong to no
group and give zeros) and rhs [G, k, n]:

    fwd:   out[r]  = lhs[r] @ rhs[g(r)]                      [m, n]
    dlhs:  d_lhs[r] = grad[r] @ rhs[g(r)]^T                  [m, k]
    drhs:  d_rhs[g] = sum_{r in g} lhs[r]^T grad[r]          [G, k, n]

all with float32 accumulation. Three kernels compute them (`Kernel.name`):

- `ragged_dot`: `jax.lax.ragged_dot_general` (XLA's grouped matmul, every platform);
- `megablox`: the Pallas TPU grouped-matmul kernels shipped with jax (`jax.experimental.pallas.ops.tpu.megablox`:
  `gmm` and `tgmm`), tiled by `Tiles` (MaxText's `wi_tile_*`/`wo_tile_*` keys); `interpret` runs them on CPU;
- `tokamax`: `tokamax.ragged_dot_general` with the named implementation (`mosaic_tpu`, `mosaic_gpu`, `triton`,
  `xla`; tokamax picks its own tiles).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp

KERNELS = ("ragged_dot", "megablox", "tokamax")

# lhs [m, k] x rhs [G, k, n]: contract lhs 1 with rhs 1 (forward), lhs 1 with rhs 2 (input gradient: rhs transposed),
# or lhs 0 with rhs 0 with lhs ragged in its contracting dimension (weight gradient: one [k, n] product per group).
_FWD = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_DLHS = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_DRHS = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])

Tile = tuple[int, int, int]  # (m, k, n) block of one product: rows, contracted, produced


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Megablox blocks of one projection's three products, each (rows, contracted, produced)."""

  fwd: Tile = (512, 1024, 1024)
  dlhs: Tile = (512, 1024, 1024)
  drhs: Tile = (512, 1024, 1024)

  def padded_rows(self, rows: int) -> int:
    """The row count megablox needs: rows rounded up so that every row tile either divides it or covers it whole."""
    padded = _round_up(rows, 8)
    while True:
      step = math.lcm(8, *(t[0] for t in (self.fwd, self.dlhs, self.drhs) if t[0] < padded))
      if _round_up(rows, step) == padded:
        return padded
      padded = _round_up(rows, step)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """Which grouped-matmul kernel runs, and how (see the module docstring)."""

  name: str = "ragged_dot"
  interpret: bool = False  # megablox: Pallas interpret mode (CPU tests)
  tokamax_implementation: str = "xla"  # tokamax: mosaic_tpu | mosaic_gpu | triton | xla

  def __post_init__(self):
    if self.name not in KERNELS:
      raise ValueError(f"unknown grouped-matmul kernel {self.name!r}; expected one of {KERNELS}")

  def fwd(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: Tile, out_dtype: Any) -> jax.Array:
    """lhs [m, k] x rhs [G, k, n] -> [m, n] in out_dtype."""
    if self.name == "megablox":
      return _megablox().gmm(lhs, rhs, group_sizes, out_dtype, _clip(tile, lhs.shape[0], lhs.shape[1], rhs.shape[2]), interpret=self.interpret)
    return self._general(lhs, rhs, group_sizes, _FWD, out_dtype)

  def dlhs(self, grad: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: Tile, out_dtype: Any) -> jax.Array:
    """grad [m, n] x rhs [G, k, n] (transposed per group) -> [m, k] in out_dtype."""
    if self.name == "megablox":
      clipped = _clip(tile, grad.shape[0], grad.shape[1], rhs.shape[1])
      return _megablox().gmm(grad, rhs, group_sizes, out_dtype, clipped, transpose_rhs=True, interpret=self.interpret)
    return self._general(grad, rhs, group_sizes, _DLHS, out_dtype)

  def drhs(self, lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array, tile: Tile, out_dtype: Any) -> jax.Array:
    """lhs [m, k], grad [m, n] -> per-group lhs^T grad [G, k, n] in out_dtype."""
    if self.name == "megablox":
      clipped = _clip(tile, lhs.shape[0], lhs.shape[1], grad.shape[1])
      groups = group_sizes.shape[0]
      return _megablox().tgmm(lhs.swapaxes(0, 1), grad, group_sizes, out_dtype, clipped, num_actual_groups=groups, interpret=self.interpret)
    return self._general(lhs, grad, group_sizes, _DRHS, out_dtype)

  def _general(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, dims: jax.lax.RaggedDotDimensionNumbers, out_dtype: Any) -> jax.Array:
    """ragged_dot_general with float32 accumulation, by XLA or by tokamax."""
    if self.name == "tokamax":
      out = _tokamax().ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32, implementation=self.tokamax_implementation)
    else:
      out = jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _clip(tile: Tile, m: int, k: int, n: int) -> Tile:
  """Blocks no larger than the arrays (megablox masks a ragged last block of k and n; m comes from Tiles.padded_rows)."""
  return (min(tile[0], m), min(tile[1], k), min(tile[2], n))


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _tokamax():
  """tokamax (only this path needs it; pyproject's `tpu` and `test` extras). It reads its options from absl flags,
  parsing sys.argv on first use; maxtext's command line is not absl's, so the flags keep their defaults."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return importlib.import_module("tokamax")


def _megablox():
  """jax's megablox kernels module (the package itself exports a `gmm` function of the same name)."""
  return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
