"""The train step exactly as `python -m maxtext.train` builds it, compiled and timed (shared by the benchmarks)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass
class CompiledStep:
  config: Any  # the run's config, with remat_policy=auto and decoder_layer_input=auto resolved as train resolves them
  mesh: jax.sharding.Mesh
  setup: Any  # maxtext.train.setup.TrainSetup
  compiled: Any  # the compiled train step
  compile_seconds: float  # every compile it took: under remat_policy=auto, the candidates' too
  choice: Any = None  # maxtext.aot.remat_auto.Choice when an auto key was resolved

  def init_state(self) -> Any:
    """The fresh train state in the formats (sharding and device layout) the compiled step takes."""
    from maxtext.train import state as state_lib

    return self.setup.init_state(state_lib.compiled_formats(self.compiled))


def compile_train_step(config: Any, log: Callable[[str], None] | None = None) -> CompiledStep:
  """Resolve the auto keys as train does (maxtext.aot.remat_auto, by compiling candidates; log gets its choice line),
  then build the run's TrainSetup and compile its jit_step against the abstract state and batch (the chosen
  candidate's compile is reused)."""
  from maxtext import mesh as mesh_lib
  from maxtext.aot import remat_auto
  from maxtext.train import setup as setup_lib

  mesh = mesh_lib.create(config)
  start = time.perf_counter()
  config, choice = remat_auto.resolve(config, mesh, setup_lib.build, log=log)
  chosen = remat_auto.chosen_step(choice)
  chosen = chosen if chosen is not None and chosen.compiled is not None else None
  with jax.set_mesh(mesh):
    setup = chosen.setup if chosen else setup_lib.build(config, mesh)
    compiled = chosen.compiled if chosen else setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile()
  return CompiledStep(config, mesh, setup, compiled, time.perf_counter() - start, choice)
