"""Lower and compile the train step maxtext.train runs, on a TPU topology's compile-only devices."""

from __future__ import annotations

import dataclasses
import re
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
  state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # per device: params, of which stored quantized kernels, opt_state
  int8_products: int = 0  # dot/convolution instructions of the compiled executable whose operands are both s8

  def summary(self) -> dict[str, Any]:
    """The machine-readable report (the last line train_compile prints)."""
    return {
      "compile_seconds": round(self.compile_seconds, 3),
      **self.memory.fields(),
      "tflops_per_step": float(f"{self.tflops_per_step:.6g}"),
      "remat_policy": self.config.remat_policy,
      "decoder_layer_input": self.config.decoder_layer_input,
      **{f"{name}_bytes": n for name, n in self.state_bytes.items()},
      "int8_products": self.int8_products,
    }

  def state_line(self, config: MaxTextConfig) -> str:
    """What the train state holds per device (the bulk of the arguments)."""
    b = self.state_bytes
    stored = f" ({memory.gib(b['quantized_kernel'])} GiB of it kernels stored {config.quantization} with their scales)" if b.get("quantized_kernel") else ""
    where = " in pinned host memory" if config.optimizer_memory_host_offload else ""
    return f"train state per device: parameters {memory.gib(b['params'])} GiB{stored}, optimizer state {memory.gib(b['opt_state'])} GiB{where}"


def topology_mesh(config: MaxTextConfig) -> Mesh:
  """The config's mesh over compile_topology x compile_topology_num_slices compile-only devices."""
  if not config.compile_topology:
    raise ConfigError("compile_topology is not set; pass e.g. compile_topology=v5p-8 (see docs/tpu.md for the names)")
  topo = topology.parse(config.compile_topology)
  return mesh_lib.create(config, devices=topology_devices(topo, config.compile_topology_num_slices))


def compile_for_topology(config: MaxTextConfig, log: Callable[[str], None] | None = None) -> CompileResult:
  """Compile the train step for config's topology; remat_policy=auto and decoder_layer_input=auto are resolved first
  (the choice goes to log)."""
  from maxtext.counting import step_flops
  from maxtext.train import setup as setup_lib

  mesh = topology_mesh(config)
  hbm = topology.parse(config.compile_topology).chip.hbm_bytes
  config, choice = remat_auto.resolve(config, mesh, setup_lib.build, hbm, log)
  step = remat_auto.chosen_step(choice)
  if step is None:
    with jax.set_mesh(mesh):
      step = memory.compile_step(setup_lib.build(config, mesh), hbm)
  flops = step_flops(config) / 1e12
  int8 = count_int8_products(step.compiled.as_text()) if step.compiled is not None and config.quantization == "int8" else 0
  state = state_breakdown(step.setup.abstract_state)
  return CompileResult(step.compiled, step.memory, step.seconds, flops, list(mesh.devices.flat), config, choice, state, int8)


_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[")
_PRODUCT = re.compile(r"=\s*\w+\[[^\]]*\]\S*\s+(?:convolution|dot)\(%?([\w.\-]+),\s*%?([\w.\-]+)\)")


def count_int8_products(hlo: str) -> int:
  """Matmul instructions (dot, or convolution as TPUs write them) of an HLO module whose two operands are s8: the
  int8 x int8 products, accumulated in int32 by the matrix units."""
  types = {m.group(1): m.group(2) for m in map(_DEFINITION.match, hlo.splitlines()) if m}
  return sum(types.get(a) == types.get(b) == "s8" for a, b in _PRODUCT.findall(hlo))


def state_breakdown(state: Any) -> dict[str, int]:
  """Per-device bytes of the train state's parameters (and of the kernels stored quantized among them) and optimizer state."""
  from maxtext.train.initial_params import stored_kernels

  quantized = [leaf for kernel, _, scale in stored_kernels(state["params"]).values() for leaf in (kernel.get_value(), scale.get_value())]
  return {
    "params": memory.shard_bytes(state["params"]),
    "quantized_kernel": memory.shard_bytes(quantized),
    "opt_state": memory.shard_bytes(state["opt_state"]),
  }
