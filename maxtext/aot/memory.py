"""Per-device memory of a compiled step, against the chip's HBM (and the sizes the run's preflight checks compare);
parses XLA's out-of-memory errors."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax

from maxtext.errors import UserError
from maxtext.layers.dtypes import bits
from maxtext.memory_limit import is_out_of_memory  # noqa: F401 - callers use memory.is_out_of_memory

EXIT_DOES_NOT_FIT = 3
MEMORY_HEADROOM = 0.95  # share of a device's memory the compiled train step (and GRPO's rollout) may plan to use
GIB = 1024**3
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": GIB, "T": 1024**4}
_SIZE = r"([\d.]+)\s*([KMGT]?)i?B?"


class DoesNotFit(UserError):
  """The step compiles for the topology but needs more memory per device than the chip has."""

  exit_code = EXIT_DOES_NOT_FIT


def gib(n: int | float) -> str:
  return f"{n / GIB:.2f}"


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * _UNITS[unit.upper()])


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes per device. total = arguments + outputs - aliased (donated) + temporaries."""

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  hbm_bytes: int
  largest: str = ""  # the largest contributor, when known
  out_of_memory: bool = False  # XLA refused to compile for lack of memory
  host_temp_bytes: int = 0  # temporaries in pinned host memory (offloaded activations), not in HBM
  host_argument_bytes: int = 0  # arguments in pinned host memory (optimizer_memory_host_offload), not in HBM

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def fits(self) -> bool:
    return not self.out_of_memory and self.total_bytes <= self.hbm_bytes

  def fields(self) -> dict[str, Any]:
    """The machine-readable memory figures (part of the JSON line the compile commands print)."""
    return {
      "argument_bytes": self.argument_bytes,
      "output_bytes": self.output_bytes,
      "temp_bytes": self.temp_bytes,
      "host_temp_bytes": self.host_temp_bytes,
      "host_argument_bytes": self.host_argument_bytes,
      "total_bytes": self.total_bytes,
      "hbm_bytes": self.hbm_bytes,
      "fits": self.fits,
    }

  def lines(self) -> list[str]:
    if self.out_of_memory:
      return [
        f"XLA ran out of memory compiling the step: arguments {gib(self.argument_bytes)} GiB (outputs alias the donated state)"
        f" + temporaries {gib(self.temp_bytes)} GiB = {gib(self.total_bytes)} GiB; {gib(self.hbm_bytes)} GiB HBM: does NOT fit"
      ]
    return [
      f"per-device memory: arguments {gib(self.argument_bytes)} GiB, outputs {gib(self.output_bytes)} GiB"
      f" (aliased {gib(self.alias_bytes)} GiB), temporaries {gib(self.temp_bytes)} GiB"
      + (f"; host temporaries {gib(self.host_temp_bytes)} GiB (pinned host memory)" if self.host_temp_bytes else "")
      + (f"; host arguments {gib(self.host_argument_bytes)} GiB (the optimizer state, pinned host memory)" if self.host_argument_bytes else ""),
      f"total {gib(self.total_bytes)} GiB of {gib(self.hbm_bytes)} GiB HBM: {'fits' if self.fits else 'does NOT fit'}",
    ]

  def does_not_fit_message(self, chip: str) -> str:
    largest = f" (largest: {self.largest})" if self.largest else ""
    needs = gib(self.total_bytes) if self.total_bytes > self.hbm_bytes else f"more than {gib(self.hbm_bytes)}"
    return f"does not fit: needs {needs} GiB per device, {chip} has {gib(self.hbm_bytes)} GiB{largest}"


def _largest_of(report: dict[str, int]) -> str:
  name = max(report, key=report.get)
  return f"{name} {gib(report[name])} GiB"


def from_compiled(compiled: jax.stages.Compiled, hbm_bytes: int) -> MemoryReport:
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError("this backend reports no memory analysis for compiled code")
  parts = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes, "temporaries": stats.temp_size_in_bytes}
  return MemoryReport(
    argument_bytes=stats.argument_size_in_bytes,
    output_bytes=stats.output_size_in_bytes,
    temp_bytes=stats.temp_size_in_bytes,
    alias_bytes=stats.alias_size_in_bytes,
    hbm_bytes=hbm_bytes,
    largest=_largest_of(parts),
    host_temp_bytes=stats.host_temp_size_in_bytes,
    host_argument_bytes=stats.host_argument_size_in_bytes,
  )


def shard_bytes(tree: Any, device_only: bool = False) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (or arrays): the largest shard, counted per leaf
  (int4 packed two per byte); device_only leaves out the leaves kept in pinned host memory."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if device_only and getattr(getattr(leaf, "sharding", None), "memory_kind", None) == "pinned_host":
      continue
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    total += math.prod(shape) * bits(leaf.dtype) // 8
  return total


def from_oom_error(error: BaseException, argument_bytes: int, hbm_bytes: int) -> MemoryReport:
  """Best estimate of what a step that failed to compile with an out-of-memory error needs per device.

  XLA says either 'the total memory required for HLO temporaries (35.00G) exceeds available HBM (15.75G)'
  or 'Used 120.5G of 95.74G hbm'; the donated state's outputs alias its arguments, so arguments + temporaries is the need.
  """
  text = str(error)
  temp, largest = 0, ""
  m = re.search(r"required for ([\w ]+?) \(" + _SIZE + r"\) exceeds", text)
  if m:
    temp, largest = _bytes(m.group(2), m.group(3)), f"{m.group(1)} {gib(_bytes(m.group(2), m.group(3)))} GiB"
  else:
    m = re.search(r"Used " + _SIZE + r" of " + _SIZE, text)
    if m:
      temp = max(0, _bytes(m.group(1), m.group(2)) - argument_bytes)
  m = re.search(r"Largest program allocations in \w+:\s*1\.\s*Size:\s*" + _SIZE + r"[\s\S]*?(?:Operator|Shape):\s*(.+)", text)
  if m:
    largest = f"{m.group(3).strip()[:120]} {gib(_bytes(m.group(1), m.group(2)))} GiB"
  return MemoryReport(argument_bytes, 0, temp, 0, hbm_bytes, largest=largest, out_of_memory=True)


@dataclasses.dataclass
class CompiledStep:
  """A train step compiled to learn what it needs: its setup (whose compiled_step is now cached), the executable
  (None: XLA ran out of memory), the per-device memory and the compile seconds."""

  setup: Any  # maxtext.train.setup.TrainSetup
  compiled: jax.stages.Compiled | None
  memory: MemoryReport
  seconds: float


def compile_step(setup: Any, hbm_bytes: int) -> CompiledStep:
  """Compile setup's train step against its abstract state and batch; an out-of-memory refusal becomes a report."""
  start = time.perf_counter()
  try:
    compiled = setup.compiled_step  # cached on the setup: the run or train_compile that picks this setup reuses it
  except Exception as e:  # XLA reports exhausted memory as a runtime error at compile time
    if not is_out_of_memory(e):
      raise
    args = shard_bytes((setup.abstract_state, setup.abstract_batch), device_only=True)
    return CompiledStep(setup, None, from_oom_error(e, args, hbm_bytes), time.perf_counter() - start)
  return CompiledStep(setup, compiled, from_compiled(compiled, hbm_bytes), time.perf_counter() - start)


def state_bytes(tree: Any) -> int:
  """Bytes of a pytree of arrays (or ShapeDtypeStructs) over all devices together (shard_bytes: one device's)."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def step_bytes(compiled: Any) -> tuple[int, int] | None:
  """(bytes one device needs to run the compiled step, of which temporaries), from XLA's memory analysis."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - some backends and deserialized executables have no analysis
    return None
  if m is None:
    return None
  need = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes + m.generated_code_size_in_bytes
  return int(need), int(m.temp_size_in_bytes)


def print_report(report: MemoryReport, summary: dict[str, Any], chip: str) -> None:
  """The compile commands' ending: the per-device memory lines and one JSON line; DoesNotFit (exit 3) past the HBM."""
  import json

  for line in report.lines():
    print(line)
  print(json.dumps(summary), flush=True)
  if not report.fits:
    raise DoesNotFit(report.does_not_fit_message(chip))
