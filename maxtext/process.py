"""Per-process setup that must happen before JAX is asked for devices.

Entry points pass `prepare` to `maxtext.config.load(..., before_devices=prepare)`.
"""

from __future__ import annotations

from maxtext import distributed, host_allocator
from maxtext.config import MaxTextConfig


def prepare(config: MaxTextConfig) -> None:
  """Tune the host allocator for CPU runs, then join the JAX distributed system if the run spans processes."""
  host_allocator.tune(config)
  distributed.initialize(config)
