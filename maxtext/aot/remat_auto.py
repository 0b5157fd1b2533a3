"""remat_policy=auto and decoder_layer_input=auto: what each layer saves for the backward pass, and where.

A candidate is a remat policy with a place for each layer's saved input: `device` (HBM) or `offload` (pinned host
memory). It fits when the compiled train step's arguments + outputs - aliased + temporaries stay within
(1 - MARGIN) of the device memory (XLA's memory analysis of the real step: the caller's setup builder, `maxtext.train.setup.build(...).jit_step`).
Among the candidates that fit, the choice has the least recomputation, then the least host traffic:

- remat policies are tried from saving everything (`none`) to saving nothing (`full`); memory falls along the list,
  so a binary search over it compiles about three policies;
- each policy is tried with its layer inputs in HBM first, and offloaded only when it does not fit that way.
  Offloading moves one [batch, seq, emb] copy per layer out and back, beside the layers' matmuls; a policy further
  down the list recomputes more of every layer's forward pass, so an offload is preferred to more recomputation.

Offloading is a candidate only where the platform policy keeps activations in pinned host memory (`host_offload`:
TPU), with scanned layers (unrolled layers gain nothing from it: benchmarks/README.md, figures behind code
comments), and not under `none`, which saves no layer input. Unresolved (a model built outside train and
train_compile), `auto` keeps the inputs in HBM. When nothing fits, the candidate that saves the most memory is
chosen and the caller's memory check reports the shortfall.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from maxtext import memory_limit, platform
from maxtext.aot import memory
from maxtext.config import MaxTextConfig

# Least recomputation first: each entry saves a subset of what the one before it saves.
CANDIDATES = ("none", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "full")
PLACES = ("device", "offload")  # where each layer's saved input is kept: least host traffic first
MARGIN = 0.10  # headroom left for fragmentation, the data pipeline's buffers and runtime allocations


@dataclasses.dataclass(frozen=True)
class Choice:
  """The remat policy and layer-input place chosen, and the compiles that decided them."""

  policy: str
  layer_input: str  # 'device' | 'offload'
  tried: dict[tuple[str, str], int]  # (policy, place) -> compiled total bytes per device (-1: XLA out of memory)
  budget_bytes: int
  auto_policy: bool  # remat_policy was auto
  auto_place: bool  # decoder_layer_input was auto
  offload_possible: bool  # offloading was a candidate here
  step: memory.CompiledStep | None = dataclasses.field(default=None, repr=False, compare=False)  # the chosen candidate, if compiled

  @property
  def fits(self) -> bool:
    bytes_ = self.tried.get((self.policy, self.layer_input))
    return bytes_ is not None and 0 <= bytes_ <= self.budget_bytes

  def _compiled(self) -> str:
    shown = {p: "out of memory" if b < 0 else f"{memory.gib(b)} GiB" for p, b in self.tried.items()}
    return ", ".join(f"{policy}/{place} {size}" for (policy, place), size in shown.items())

  def reason(self) -> str:
    """Why the layer inputs are where they are, in a few words (the banner's)."""
    if not self.auto_place:
      return f"decoder_layer_input={self.layer_input}"
    if not self.offload_possible:
      return "decoder_layer_input=auto: offloading is tried only for scanned layers on TPU"
    if self.policy == "none":
      return "decoder_layer_input=auto: remat_policy=none saves no layer input"
    if self.layer_input == "device":
      return "decoder_layer_input=auto: the step fits with them in HBM"
    return "decoder_layer_input=auto: the step does not fit with them in HBM"

  def line(self) -> str:
    """The choice, why, and what was compiled to make it (printed by train and train_compile)."""
    keys = " and ".join(k for k, auto in (("remat_policy=auto", self.auto_policy), ("decoder_layer_input=auto", self.auto_place)) if auto)
    where = "pinned host memory" if self.layer_input == "offload" else "device memory"
    why = []
    if self.auto_policy:
      if self.fits:
        why.append("the least recomputation that fits")
      elif (self.policy, self.layer_input) in self.tried:
        why.append("nothing fits: the candidate that saves the most memory")
      else:
        why.append("no policy that saves more fits")
    if self.auto_place:
      why.append(self.reason().split(": ", 1)[1])
    budget = f"budget {memory.gib(self.budget_bytes)} GiB per device"
    compiled = f"; compiled: {self._compiled()}" if self.tried else ""
    return f"{keys} chose remat_policy={self.policy} with each layer's saved input in {where} ({'; '.join(why)}; {budget}{compiled})"


def saved_input(offloaded: bool, configured: str, choice: Choice | None) -> str:
  """Where each layer's saved input is kept and why, as the train banner and train_compile say it."""
  where = "pinned host memory" if offloaded else "device memory"
  return f"each layer's saved input in {where} ({choice.reason() if choice else f'decoder_layer_input={configured}'})"


def places(config: MaxTextConfig, policy: str, offload_possible: bool) -> tuple[str, ...]:
  """The layer-input places to try under policy, in order."""
  if config.decoder_layer_input != "auto":
    return (config.decoder_layer_input,)
  return PLACES if offload_possible and policy != "none" else ("device",)


def choose(config: MaxTextConfig, hbm_bytes: int, compiled_bytes: Callable[[MaxTextConfig], int | None], offload_possible: bool) -> Choice:
  """The first candidate (CANDIDATES x places) whose compiled_bytes(config with it) fits; None = XLA out of memory.

  A policy fits when any of its places does, so the policies keep their order and a binary search finds the first.
  """
  budget = int(hbm_bytes * (1 - MARGIN))
  policies = CANDIDATES if config.remat_policy == "auto" else (config.remat_policy,)
  tried: dict[tuple[str, str], int] = {}
  fitting: dict[str, str | None] = {}  # policy -> the first place that fits (None: none does)

  def first_fit(policy: str) -> str | None:
    if policy not in fitting:
      fitting[policy] = None
      for place in places(config, policy, offload_possible):
        total = compiled_bytes(with_choice(config, policy, place))
        tried[(policy, place)] = total if total is not None else -1
        if total is not None and total <= budget:
          fitting[policy] = place
          break
    return fitting[policy]

  lo, hi = 0, len(policies) - 1  # hi: chosen when nothing before it fits
  while lo < hi:
    mid = (lo + hi) // 2
    if first_fit(policies[mid]) is not None:
      hi = mid
    else:
      lo = mid + 1
  policy = policies[lo]
  options = places(config, policy, offload_possible)
  # With one place there is nothing to decide (and nothing to compile); else its first that fits, or the one that
  # saves the most when none does.
  place = (first_fit(policy) if len(options) > 1 else None) or options[-1]
  return Choice(policy, place, tried, budget, config.remat_policy == "auto", config.decoder_layer_input == "auto", offload_possible)


def with_choice(config: MaxTextConfig, policy: str, layer_input: str) -> MaxTextConfig:
  return config.model_copy(update={"remat_policy": policy, "decoder_layer_input": layer_input})


def chosen_step(choice: Choice | None) -> memory.CompiledStep | None:
  """The chosen candidate's step as `resolve` compiled it (its setup, and its executable unless XLA ran out of
  memory); None when nothing was auto or the choice was never compiled, and the caller builds it."""
  return None if choice is None else choice.step


def resolve(
  config: MaxTextConfig,
  mesh: jax.sharding.Mesh,
  build: Callable[[MaxTextConfig, jax.sharding.Mesh], Any],
  hbm_bytes: int | None = None,
  log: Callable[[str], None] | None = None,
) -> tuple[MaxTextConfig, Choice | None]:
  """config with remat_policy=auto and decoder_layer_input=auto replaced by the choice (unchanged, and no choice,
  when neither is auto); logs the choice. build(candidate, mesh) gives the candidate's train setup
  (maxtext.train.setup.build), whose step is compiled. The chosen candidate's compiled step, when it was compiled,
  comes with the choice (`Choice.step`), so the caller does not compile it again."""
  if config.remat_policy != "auto" and config.decoder_layer_input != "auto":
    return config, None
  offload_possible = platform.resolve(config, mesh).host_offload and config.scan_layers
  hbm = hbm_bytes if hbm_bytes is not None else memory_limit.limit_per_device(list(mesh.devices.flat)).bytes
  steps: dict[tuple[str, str], memory.CompiledStep] = {}

  def total_bytes(candidate: MaxTextConfig) -> int | None:
    with jax.set_mesh(mesh):
      step = memory.compile_step(build(candidate, mesh), hbm)
    steps[(candidate.remat_policy, candidate.decoder_layer_input)] = step
    return None if step.compiled is None else step.memory.total_bytes

  choice = choose(config, hbm, total_bytes, offload_possible)
  choice = dataclasses.replace(choice, step=steps.get((choice.policy, choice.layer_input)))
  if log is not None and (choice.tried or choice.auto_policy):
    log(choice.line())
  return with_choice(config, choice.policy, choice.layer_input), choice
