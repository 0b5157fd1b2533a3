"""Logical axis names -> mesh axes (logical_to_spec), and activation sharding constraints by them (a no-op outside a
mesh context)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

Rules = Sequence[tuple[str, Sequence[str]]]
LogicalAxes = Sequence[str | None]


def logical_to_spec(axes: LogicalAxes | None, rules: Sequence[tuple[str, Sequence[str]]], mesh: Mesh) -> PartitionSpec:
  """PartitionSpec for logical axis names under the rules; a mesh axis is used once at most."""
  if axes is None:
    return PartitionSpec()
  table = {name: tuple(mesh_axes) for name, mesh_axes in rules}
  used: set[str] = set()
  spec: list[str | tuple[str, ...] | None] = []
  for name in axes:
    if name is None or name not in table:
      spec.append(None)
      continue
    chosen = tuple(a for a in table[name] if a not in used and mesh.shape.get(a, 1) > 1)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return PartitionSpec(*spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Rules) -> jax.Array:
  """Constrain x to the sharding its logical axes map to under the active mesh (jax.set_mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, rules, mesh))
