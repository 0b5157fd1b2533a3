"""Compile-only TPU devices for a topology name (needs the libtpu package, no TPU)."""

from __future__ import annotations

import os
from typing import Any

import jax

from maxtext import topology
from maxtext.errors import ConfigError
from maxtext.platform import has_tpu_chips


def _compile_only_libtpu() -> None:
  """On a host without TPU chips: give libtpu the single-host facts it otherwise warns about, and let several
  compile-only processes load it at once (its lock file guards chips, and there are none)."""
  if not has_tpu_chips():
    defaults = (("TPU_ACCELERATOR_TYPE", "v5p-8"), ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"))
    for key, value in defaults:
      os.environ.setdefault(key, value)


def topology_devices(topo: topology.Topology, num_slices: int = 1) -> list[jax.Device]:
  """All devices of num_slices slices of topo, in id order; multi-slice devices carry slice_index."""
  from jax.experimental import topologies

  _compile_only_libtpu()
  try:
    desc = topologies.get_topology_desc(
      platform="tpu",
      topology_name=topo.topology_name,
      chip_config_name=topo.chip.chip_config_name,
      chips_per_host_bounds=topo.chips_per_host_bounds,
      num_slices=num_slices,
    )
  except Exception as e:  # libtpu missing or too old: the cause is one of these, never user data
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ConfigError(
      f"cannot build compile-only devices for {topo.name} ({first}); install the TPU compiler with `pip install 'maxtext[tpu]'` or `pip install libtpu`"
    ) from None
  devices = list(desc.devices)
  expected = topo.chips * num_slices
  if len(devices) != expected:
    raise ConfigError(
      f"libtpu returned {len(devices)} devices for {topo.name} x {num_slices} slices, expected {expected}; update libtpu to the version jax[tpu] pins"
    )
  return devices


def load_for_topology(argv: list[str], example: str) -> tuple[Any, str]:
  """(config, chip generation) for a compile command: compile_topology must be set (example: a topology name for the error)."""
  from maxtext.config import load

  config = load(argv)
  if not config.compile_topology:
    raise ConfigError(f"compile_topology is not set; pass e.g. compile_topology={example} (names: docs/tpu.md)")
  return config, topology.parse(config.compile_topology).chip.generation
