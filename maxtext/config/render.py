"""Render configs/base.yml from the schema and print resolved configs (`maxtext.config`)."""

from __future__ import annotations

import json
from typing import Any

import yaml
from pydantic import BaseModel

from maxtext.config.maxtext_config import SECTION_CLASSES, MaxTextConfig
from maxtext.config.sections import DerivedValues

HEADER = """\
# maxtext base config: every key with its default and a one-line comment.
# Generated from maxtext/config/sections.py and model_sections.py by scripts/render_base_yml.py;
# tests/test_config_schema.py fails if the two drift apart.
# Override any key with key=value on the command line or an M_<KEY> environment variable.
"""


def yaml_value(value: Any) -> str:
  return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def render_base_yml() -> str:
  lines = [HEADER]
  for cls in SECTION_CLASSES:
    if cls is DerivedValues:
      continue
    lines.append(f"\n# --- {cls.__name__} ---")
    for name, field in cls.model_fields.items():
      default = field.get_default(call_default_factory=True)
      if isinstance(default, BaseModel):
        lines.append(f"{name}:  # {field.description}")
        for sub, subfield in type(default).model_fields.items():
          lines.append(f"  {sub}: {yaml_value(getattr(default, sub))}  # {subfield.description}")
        continue
      lines.append(f"{name}: {yaml_value(default)}  # {field.description}")
  return "\n".join(lines) + "\n"


def _plain(value: Any) -> Any:
  if isinstance(value, BaseModel):
    return value.model_dump()
  if isinstance(value, tuple):
    return [_plain(v) for v in value]
  if isinstance(value, list):
    return [_plain(v) for v in value]
  return value


def resolved(config: MaxTextConfig, sources: dict[str, str]) -> dict[str, dict[str, Any]]:
  """key -> {value, source} for every key, nested keys dotted."""
  out: dict[str, dict[str, Any]] = {}
  for key in (k for cls in SECTION_CLASSES for k in cls.model_fields):
    value = getattr(config, key)
    if isinstance(value, BaseModel):
      for sub in type(value).model_fields:
        dotted = f"{key}.{sub}"
        out[dotted] = {"value": _plain(getattr(value, sub)), "source": sources.get(dotted, "default")}
    else:
      out[key] = {"value": _plain(value), "source": sources.get(key, "derived")}
  for key, value in sorted(getattr(sources, "maxtext_only", {}).items()):  # MaxText keys without effect here
    out[key] = {"value": _plain(value), "source": sources[key]}
  return out


def format_text(table: dict[str, dict[str, Any]]) -> str:
  """One `key = value  # source` line per key, keys and (short) values aligned in columns."""
  values = {k: yaml_value(v["value"]) for k, v in table.items()}
  key_width = max(len(k) for k in table)
  value_width = min(40, max(len(v) for v in values.values()))
  return "\n".join(f"{k:<{key_width}} = {values[k]:<{value_width}}  # {v['source']}" for k, v in table.items())


def format_json(table: dict[str, dict[str, Any]]) -> str:
  return json.dumps(table, indent=1)
