"""configs/models/<model_name>.yml: found by name, its family and what it describes checked, its axis rules merged by name."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from maxtext.config import maxtext_keys
from maxtext.config.keys import Sources, schema_field
from maxtext.errors import ConfigError, echo

PACKAGE_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def model_file_path(model_name: str, config_path: Path) -> Path:
  if not model_name or "/" in model_name or "\\" in model_name or model_name.startswith("."):
    raise ConfigError(f"invalid value for 'model_name': {echo(model_name)}; use a file name from configs/models/ without '.yml' (e.g. llama3.1-8b)")
  candidates = [config_path.parent / "models" / f"{model_name}.yml", PACKAGE_CONFIG_DIR / "models" / f"{model_name}.yml"]
  for c in candidates:
    if c.is_file():
      return c
  names = sorted({p.stem for d in candidates for p in d.parent.glob("*.yml")})
  raise ConfigError(f"unknown model_name '{model_name}'; available: {_grouped(names) or 'none'} (files in configs/models/)")


def _grouped(names: list[str]) -> str:
  """Model names grouped by family prefix (up to the first '-' before a digit), one line: 'gemma2-{27b,2b,9b},
  mistral-7b, qwen3-{0.6b,1.7b-base,...}, ...'."""
  groups: dict[str, list[str]] = {}
  for name in names:
    sized = re.match(r"(.+?)-(\d.*)$", name)
    prefix, size = sized.groups() if sized else (name.rpartition("-")[0], name.rpartition("-")[2])
    groups.setdefault(prefix or size, []).append(size if prefix else "")
  return ", ".join(p if sizes == [""] else f"{p}-{sizes[0]}" if len(sizes) == 1 else f"{p}-{{{','.join(sizes)}}}" for p, sizes in groups.items())


def merged_axis_rules(base: Any, update: Any, model_path: Path) -> list[list[Any]]:
  """The rules `base` (this project's default when unset or MaxText's default) with the model file's rules replacing
  or adding rules by logical name; MaxText's `[name, 'axis']` is `[name, ['axis']]`."""
  if base is None or maxtext_keys.is_default("logical_axis_rules", base):
    base = schema_field("logical_axis_rules").get_default(call_default_factory=True)
  if not isinstance(update, list) or not all(isinstance(r, list | tuple) and len(r) == 2 for r in update):
    raise ConfigError(f"logical_axis_rules in models/{model_path.name} must be a list of [logical_name, [mesh axes]]; fix the file")
  rules = {str(name): list(axes) for name, axes in base}
  for name, axes in update:
    rules[str(name)] = [axes] if isinstance(axes, str) else list(axes)
  return [[name, axes] for name, axes in rules.items()]


def check_family(values: Mapping[str, Any], sources: Sources) -> None:
  """An unbuilt decoder_block is the cause, named before any key of its family that this schema lacks (MaxText's gpt3
  files' trainable_position_size): one line naming the families built here."""
  from maxtext.models import registry  # the config loads before any model code otherwise

  block = values.get("decoder_block")
  if isinstance(block, str) and block not in registry.FAMILIES:
    raise ConfigError(
      f"invalid value for 'decoder_block' ({sources.get('decoder_block', 'default')}): {echo(block)}; this project does not build that family; "
      f"the families built here: {', '.join(registry.FAMILIES)}"
    )


def check_model_file(model: Mapping[str, Any], model_path: Path) -> None:
  """What MaxText's model files describe that is not built here, named before any other key of the file is read:
  block-scaled float8 checkpoints (the -fp8 files' weight_dtype float8_e4m3fn) and audio input (Qwen3-Omni)."""
  if model.get("use_audio") is True:
    raise ConfigError(
      f"use_audio: true (in models/{model_path.name}): this project builds no audio encoder; its decoders take text, and images (docs/vision.md)"
    )
  dtype = model.get("weight_dtype")
  if isinstance(dtype, str) and dtype.startswith("float8"):
    plain = model_path.stem.removesuffix("-fp8")
    raise ConfigError(
      f"weight_dtype '{dtype}' (in models/{model_path.name}): this project keeps weights in float32 or bfloat16 and does not load block-scaled "
      f"float8 checkpoints; use model_name={plain} (its bfloat16 weights) with quantization=fp8 for fp8 matmuls"
    )
