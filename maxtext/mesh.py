"""Device mesh from ici_*/dcn_* parallelism, and logical-axis -> mesh-axis sharding."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtext import platform
from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError
from maxtext.layers.sharding import LogicalAxes, logical_to_spec  # noqa: F401  (mesh.logical_to_spec for its callers)


def create(config: MaxTextConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh with config.mesh_axes; multi-slice devices form a hybrid (ICI x DCN) mesh."""
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) != config.num_devices:
    raise ConfigError(
      f"the config was resolved for {config.num_devices} devices but {len(devices)} are present; "
      f"load it here with maxtext.config.load(..., devices=maxtext.process.prepare), which counts JAX's devices, or num_devices={len(devices)}"
    )
  ici, dcn = list(config.ici_parallelism), list(config.dcn_parallelism)
  if config.num_slices > 1:
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
  elif len(devices) == 1 or platform.platform_of(devices) == "cpu":
    grid = np.array(devices).reshape(ici)
  else:
    grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
  return Mesh(grid, tuple(config.mesh_axes))


def logical_sharding(axes: LogicalAxes | None, config: MaxTextConfig, mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes, config.logical_axis_rules, mesh))


def checked_logical_sharding(axes: LogicalAxes | None, shape: Sequence[int], config: MaxTextConfig, mesh: Mesh, name: str) -> NamedSharding:
  """logical_sharding for an array of this shape; a dimension the mesh axes do not divide is a one-line ConfigError."""
  sharding = logical_sharding(axes, config, mesh)
  for dim, (size, part) in enumerate(zip(shape, sharding.spec, strict=False)):
    names = (part,) if isinstance(part, str) else tuple(part or ())
    ways = math.prod(mesh.shape[n] for n in names)
    if size % ways:
      raise ConfigError(
        f"{name} dimension {dim} (logical '{axes[dim]}', size {size}) cannot be split {ways} ways over mesh axes {names}; "
        "change the ici/dcn parallelism or logical_axis_rules"
      )
  return sharding


def data_sharding(config: MaxTextConfig, mesh: Mesh) -> NamedSharding:
  """Sharding of a [batch, seq] input array: batch over config.data_sharding."""
  axes = tuple(a for a in config.data_sharding if mesh.shape.get(a, 1) > 1)
  return NamedSharding(mesh, PartitionSpec(axes if axes else None, None))


def over_axis(sharding: NamedSharding, shape: tuple[int, ...], axis: str) -> NamedSharding:
  """sharding with its array also split over mesh axis `axis`, on the dimension that then keeps the largest
  shards; unchanged where the axis has size 1, is already used, or divides no dimension with the axes there."""
  mesh, size = sharding.mesh, sharding.mesh.shape.get(axis, 1)
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  names = [(p,) if isinstance(p, str) else tuple(p or ()) for p in spec]
  if size == 1 or any(axis in n for n in names):
    return sharding
  ways = [math.prod(mesh.shape[a] for a in n) * size for n in names]
  fits = [d for d in range(len(shape)) if shape[d] % ways[d] == 0]
  if not fits:
    return sharding
  dim = max(fits, key=lambda d: shape[d] // ways[d])
  spec[dim] = (*names[dim], axis)
  return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)
