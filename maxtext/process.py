"""Per-process setup that must happen before JAX is asked for devices.

Entry points call `maxtext.platform.choose_platform()` first thing and pass `prepare` to
`maxtext.config.load(..., before_devices=prepare)`.
"""

from __future__ import annotations

from maxtext.config import MaxTextConfig


def prepare(config: MaxTextConfig) -> None:
  """Pick the platform, tune the host allocator for CPU runs, then join the JAX distributed system if the run spans processes."""
  from maxtext import distributed, host_allocator
  from maxtext.platform import choose_platform

  choose_platform()
  host_allocator.tune(config)
  distributed.initialize(config)
