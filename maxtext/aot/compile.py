"""Lower and compile the train step maxtext.train runs, on a TPU topology's compile-only devices."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from maxtext import mesh as mesh_lib
from maxtext import topology
from maxtext.aot import memory, remat_auto
from maxtext.aot.devices import topology_devices
from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError


@dataclasses.dataclass
class CompileResult:
  compiled: jax.stages.Compiled | None  # None when XLA ran out of memory
  memory: memory.MemoryReport
  compile_seconds: float
  tflops_per_step: float  # model TFLOPs of one step over the global batch
  devices: list[jax.Device]
  remat_policy: str = ""  # the policy compiled (remat_policy=auto resolved)

  def summary(self) -> dict[str, Any]:
    """The machine-readable report (the last line train_compile prints)."""
    return {
      "compile_seconds": round(self.compile_seconds, 3),
      **self.memory.fields(),
      "tflops_per_step": float(f"{self.tflops_per_step:.6g}"),
      "remat_policy": self.remat_policy,
    }


def topology_mesh(config: MaxTextConfig) -> Mesh:
  """The config's mesh over compile_topology x compile_topology_num_slices compile-only devices."""
  if not config.compile_topology:
    raise ConfigError("compile_topology is not set; pass e.g. compile_topology=v5p-8 (see docs/tpu.md for the names)")
  topo = topology.parse(config.compile_topology)
  return mesh_lib.create(config, devices=topology_devices(topo, config.compile_topology_num_slices))


def compile_step(setup: Any, hbm_bytes: int) -> tuple[jax.stages.Compiled | None, memory.MemoryReport, float]:
  """Compile setup.jit_step against its abstract state and batch; an out-of-memory refusal becomes a report."""
  start = time.perf_counter()
  try:
    compiled = setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile()
  except Exception as e:  # XLA reports exhausted memory as a runtime error at compile time
    if not memory.is_out_of_memory(e):
      raise
    args = memory.shard_bytes((setup.abstract_state, setup.abstract_batch))
    return None, memory.from_oom_error(e, args, hbm_bytes), time.perf_counter() - start
  return compiled, memory.from_compiled(compiled, hbm_bytes), time.perf_counter() - start


def compile_for_topology(config: MaxTextConfig, log: Callable[[str], None] | None = None) -> CompileResult:
  """Compile the train step for config's topology; remat_policy=auto is resolved first (its choice goes to log)."""
  from maxtext.models.counting import training_flops_per_step
  from maxtext.train import setup as setup_lib

  mesh = topology_mesh(config)
  hbm = topology.parse(config.compile_topology).chip.hbm_bytes
  config = remat_auto.resolve(config, mesh, hbm, log)
  with jax.set_mesh(mesh):
    setup = setup_lib.build(config, mesh)
    compiled, report, seconds = compile_step(setup, hbm)
  return CompileResult(compiled, report, seconds, training_flops_per_step(config) / 1e12, list(mesh.devices.flat), config.remat_policy)
