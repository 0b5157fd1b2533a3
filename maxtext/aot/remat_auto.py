"""remat_policy=auto: the least recomputation whose compiled train step fits the device memory with a margin.

The candidates run from saving everything (`none`) to saving nothing (`full`); memory falls along the list, so a
binary search over it compiles about three steps (each candidate's memory comes from XLA's memory analysis of
the real step, `maxtext.train.setup.build(...).jit_step`). A candidate fits when arguments + outputs - aliased +
temporaries stay within (1 - MARGIN) of the device memory. When nothing fits, `full` is chosen and the caller's
own memory check reports the shortfall.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from maxtext import memory_limit
from maxtext.aot import memory
from maxtext.config import MaxTextConfig

# Least recomputation first: each entry saves a subset of what the one before it saves.
CANDIDATES = ("none", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "full")
MARGIN = 0.10  # headroom left for fragmentation, the data pipeline's buffers and runtime allocations


@dataclasses.dataclass(frozen=True)
class Choice:
  policy: str
  tried: dict[str, int]  # candidate -> compiled total bytes per device (a missing entry was not compiled)
  budget_bytes: int

  def line(self) -> str:
    tried = ", ".join(f"{p} {memory.gib(b)} GiB" for p, b in self.tried.items())
    return f"remat_policy=auto chose {self.policy} (budget {memory.gib(self.budget_bytes)} GiB per device; compiled: {tried})"


def choose(config: MaxTextConfig, hbm_bytes: int, compiled_bytes: Callable[[MaxTextConfig], int | None]) -> Choice:
  """Binary search CANDIDATES for the first policy whose compiled_bytes(config with it) fits; None = XLA out of memory."""
  budget = int(hbm_bytes * (1 - MARGIN))
  tried: dict[str, int] = {}

  def fits(i: int) -> bool:
    total = compiled_bytes(with_policy(config, CANDIDATES[i]))
    tried[CANDIDATES[i]] = total if total is not None else -1
    return total is not None and total <= budget

  lo, hi = 0, len(CANDIDATES) - 1  # hi: 'full', chosen when nothing before it fits
  while lo < hi:
    mid = (lo + hi) // 2
    if fits(mid):
      hi = mid
    else:
      lo = mid + 1
  return Choice(CANDIDATES[lo], {p: b for p, b in tried.items() if b >= 0}, budget)


def with_policy(config: MaxTextConfig, policy: str) -> MaxTextConfig:
  return config.model_copy(update={"remat_policy": policy})


def step_bytes(config: MaxTextConfig, mesh: jax.sharding.Mesh) -> int | None:
  """Total bytes per device of config's compiled train step on mesh; None when XLA runs out of memory compiling it."""
  from maxtext.train import setup as setup_lib

  with jax.set_mesh(mesh):
    setup = setup_lib.build(config, mesh)
    try:
      compiled = setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile()
    except Exception as e:  # XLA reports exhausted memory as a runtime error at compile time
      if not memory.is_out_of_memory(e):
        raise
      return None
  return memory.from_compiled(compiled, 0).total_bytes


def resolve(config: MaxTextConfig, mesh: jax.sharding.Mesh, hbm_bytes: int | None = None, log: Callable[[str], None] | None = None) -> MaxTextConfig:
  """config with remat_policy=auto replaced by the chosen policy (unchanged otherwise); logs the choice."""
  if config.remat_policy != "auto":
    return config
  hbm = hbm_bytes if hbm_bytes is not None else memory_limit.limit_per_device(list(mesh.devices.flat)).bytes
  choice = choose(config, hbm, lambda c: step_bytes(c, mesh))
  if log is not None:
    log(choice.line())
  return with_policy(config, choice.policy)
