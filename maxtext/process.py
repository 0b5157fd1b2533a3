"""Per-process setup that must happen before JAX is asked for devices.

Entry points pass `prepare` to `maxtext.config.load(..., devices=prepare)`: it sets the process up for the
user's config and returns the device counts the config is resolved for.
"""

from __future__ import annotations

from maxtext.config import MaxTextConfig


def prepare(config: MaxTextConfig) -> tuple[int, int]:
  """Tune the host allocator for CPU runs, join the JAX distributed system if the run spans processes, then count
  JAX's devices: (num_devices, num_slices). (`import maxtext` has chosen the platform: maxtext.platform.choose_platform.)"""
  from maxtext import distributed, host_allocator, platform

  host_allocator.tune(config)
  distributed.initialize(config)
  return platform.device_counts(config, start=True)
