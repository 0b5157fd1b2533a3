"""Activation sharding constraints by logical axis name; a no-op outside a mesh context."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from maxtext.mesh import logical_to_spec

Rules = Sequence[tuple[str, Sequence[str]]]


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Rules) -> jax.Array:
  """Constrain x to the sharding its logical axes map to under the active mesh (jax.set_mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, rules, mesh))
