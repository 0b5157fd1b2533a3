"""Lower and compile the train step maxtext.train runs, on a TPU topology's compile-only devices."""

from __future__ import annotations

import dataclasses
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
  config: MaxTextConfig  # the config compiled: remat_policy=auto and decoder_layer_input=auto resolved
  choice: remat_auto.Choice | None = None  # how they were resolved (None: neither was auto)

  def summary(self) -> dict[str, Any]:
    """The machine-readable report (the last line train_compile prints)."""
    return {
      "compile_seconds": round(self.compile_seconds, 3),
      **self.memory.fields(),
      "tflops_per_step": float(f"{self.tflops_per_step:.6g}"),
      "remat_policy": self.config.remat_policy,
      "decoder_layer_input": self.config.decoder_layer_input,
    }


def topology_mesh(config: MaxTextConfig) -> Mesh:
  """The config's mesh over compile_topology x compile_topology_num_slices compile-only devices."""
  if not config.compile_topology:
    raise ConfigError("compile_topology is not set; pass e.g. compile_topology=v5p-8 (see docs/tpu.md for the names)")
  topo = topology.parse(config.compile_topology)
  return mesh_lib.create(config, devices=topology_devices(topo, config.compile_topology_num_slices))


def compile_for_topology(config: MaxTextConfig, log: Callable[[str], None] | None = None) -> CompileResult:
  """Compile the train step for config's topology; remat_policy=auto and decoder_layer_input=auto are resolved first
  (the choice goes to log)."""
  from maxtext.models.counting import step_flops
  from maxtext.train import setup as setup_lib

  mesh = topology_mesh(config)
  hbm = topology.parse(config.compile_topology).chip.hbm_bytes
  config, choice = remat_auto.resolve(config, mesh, setup_lib.build, hbm, log)
  step = choice.step if choice is not None else None  # the chosen candidate, compiled while choosing
  if step is None:
    with jax.set_mesh(mesh):
      step = memory.compile_step(setup_lib.build(config, mesh), hbm)
  flops = step_flops(config) / 1e12
  return CompileResult(step.compiled, step.memory, step.seconds, flops, list(mesh.devices.flat), config, choice)
