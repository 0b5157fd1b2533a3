"""The train step exactly as `python -m maxtext.train` builds it, compiled and timed (shared by the benchmarks)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax


@dataclasses.dataclass
class CompiledStep:
  config: Any
  mesh: jax.sharding.Mesh
  setup: Any  # maxtext.train.setup.TrainSetup
  compiled: Any  # the compiled train step
  compile_seconds: float

  def init_state(self) -> Any:
    """The fresh train state in the formats (sharding and device layout) the compiled step takes."""
    from maxtext.train import state as state_lib

    return self.setup.init_state(state_lib.compiled_formats(self.compiled))


def compile_train_step(config: Any) -> CompiledStep:
  """Build the run's TrainSetup and compile its jit_step against the abstract state and batch."""
  from maxtext import mesh as mesh_lib
  from maxtext.train import setup as setup_lib

  mesh = mesh_lib.create(config)
  with jax.set_mesh(mesh):
    setup = setup_lib.build(config, mesh)
    start = time.perf_counter()
    compiled = setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile()
  return CompiledStep(config, mesh, setup, compiled, time.perf_counter() - start)
