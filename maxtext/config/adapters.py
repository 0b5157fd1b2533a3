"""The LoRA adapter slots a config names: `lora.lora_adapters` parsed and checked, and the rules that place them.

With lora.max_lora_adapters = 1 there is one slot, 'default', of rank lora.lora_rank. With more, each slot has a
name and a rank up to max_lora_rank (`lora_adapters` entries 'name' or 'name:rank'; unnamed slots are adapter_<i>).
In the parameters, every adapter matrix sits at a path ending lora/lora_a or lora/lora_b, and a multi-adapter
model stacks the slots on one axis of those matrices (after the 'layers' axis of scanned layers).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from maxtext.errors import ConfigError

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig

ADAPTER_PATH_ENDS = ("lora/lora_a", "lora/lora_b")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
  """One adapter slot: its name (for saving, exporting and loading) and its rank."""

  name: str
  rank: int


def adapter_specs(config: MaxTextConfig) -> list[AdapterSpec]:
  """The adapter slots of the config, validated (one 'default' slot unless lora.max_lora_adapters > 1)."""
  cfg = config.lora
  slots = cfg.max_lora_adapters
  if slots == 1:
    if cfg.lora_adapters or cfg.max_lora_rank:
      raise ConfigError("lora.lora_adapters and lora.max_lora_rank apply to lora.max_lora_adapters > 1; set max_lora_adapters or drop them")
    return [AdapterSpec("default", cfg.lora_rank)]
  top = max_rank(config)
  if not cfg.lora_adapters:
    return [AdapterSpec(f"adapter_{i}", min(cfg.lora_rank, top)) for i in range(slots)]
  if len(cfg.lora_adapters) != slots:
    raise ConfigError(f"lora.lora_adapters names {len(cfg.lora_adapters)} adapters but lora.max_lora_adapters is {slots}; name one per slot")
  specs = []
  for entry in cfg.lora_adapters:
    name, _, rank_text = str(entry).partition(":")
    if not _NAME.match(name) or (rank_text and not rank_text.isdigit()):
      raise ConfigError(f"invalid lora.lora_adapters entry {entry!r}; use 'name' or 'name:rank' (name of letters, digits, '_', '.', '-')")
    rank = int(rank_text) if rank_text else min(cfg.lora_rank, top)
    if not 0 < rank <= top:
      raise ConfigError(f"adapter '{name}' has rank {rank}; ranks must be in 1..lora.max_lora_rank ({top})")
    specs.append(AdapterSpec(name, rank))
  if len({s.name for s in specs}) != len(specs):
    raise ConfigError(f"lora.lora_adapters has duplicate names: {cfg.lora_adapters}; give each slot its own name")
  return specs


def adapter_names(config: MaxTextConfig) -> list[str]:
  """The slots' names, in slot order."""
  return [spec.name for spec in adapter_specs(config)]


def max_rank(config: MaxTextConfig) -> int:
  """The rank every slot's matrices are allocated at (a slot of lower rank uses the first columns)."""
  return config.lora.max_lora_rank or config.lora.lora_rank


def slot_index(config: MaxTextConfig, name: str) -> tuple[int, AdapterSpec]:
  """The slot number and spec of adapter `name`; a name the config lacks is a ConfigError listing the names."""
  specs = adapter_specs(config)
  for i, spec in enumerate(specs):
    if spec.name == name:
      return i, spec
  raise ConfigError(f"no adapter named '{name}'; this config's adapters are {', '.join(s.name for s in specs)}")


def single_adapter_config(config: MaxTextConfig, name: str) -> MaxTextConfig:
  """The config of a one-adapter model holding only adapter `name` of a multi-adapter config (its rank, same alpha)."""
  _, spec = slot_index(config, name)
  lora = config.lora.model_copy(update={"max_lora_adapters": 1, "max_lora_rank": 0, "lora_adapters": [], "lora_rank": spec.rank})
  return config.model_copy(update={"lora": lora})


def slot_axis(config: MaxTextConfig) -> int:
  """The slot axis of a multi-adapter model's A and B: after the 'layers' axis of scanned layers."""
  return 1 if config.scan_layers else 0


def is_adapter_path(path: str) -> bool:
  """A '/'-joined parameter path that names an adapter matrix (ends lora/lora_a or lora/lora_b)."""
  return path.endswith(ADAPTER_PATH_ENDS)
