"""The settable keys of a config: their schema fields, nested sections as dotted keys, and the one-line error for an unknown key."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from maxtext.config import maxtext_keys
from maxtext.config.maxtext_config import DERIVED_KEYS, MaxTextConfig
from maxtext.errors import ConfigError, echo

NESTED_SECTIONS = {"lora": MaxTextConfig.model_fields["lora"].annotation}

# key -> where its value came from; filled for every key of the final config.
Sources = dict[str, str]


def schema_field(key: str) -> Any:
  """The pydantic FieldInfo of a settable key ('section.key' for nested ones), or None."""
  if "." in key:
    head, tail = key.split(".", 1)
    cls = NESTED_SECTIONS.get(head)
    return cls.model_fields.get(tail) if cls is not None else None
  return MaxTextConfig.model_fields.get(key)


def all_keys() -> list[str]:
  """Every settable key, nested ones as 'section.key'."""
  keys = [k for k in MaxTextConfig.model_fields if k not in DERIVED_KEYS and k not in NESTED_SECTIONS]
  for name, cls in NESTED_SECTIONS.items():
    keys += [f"{name}.{k}" for k in cls.model_fields]
  return keys


def unknown_key_error(key: str, where: str) -> ConfigError:
  if key in DERIVED_KEYS:
    return ConfigError(f"config key '{key}' ({where}) is derived and cannot be set; see `python -m maxtext.config` for what it is computed from")
  if maxtext_keys.is_maxtext_key(key):
    default = maxtext_keys.defaults()[key]
    accepted = f"only its MaxText default {default!r} is accepted (it has no effect)" if maxtext_keys.is_default(key, default) else "no value is accepted"
    return ConfigError(f"config key '{key}' ({where}) is a MaxText option this project does not implement; {accepted}; remove it")
  close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
  hint = f" (did you mean '{close[0]}'?)" if close else ""
  return ConfigError(f"unknown config key '{key}'{hint} {where}")


def flatten(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
  """Nested sections (`lora: {enable_lora: true}`) become dotted keys; every key is checked.

  A MaxText key the schema lacks, at MaxText's default, is kept (it has no effect; load_with_sources sets it aside)."""
  known = set(all_keys())
  flat: dict[str, Any] = {}
  for key, value in raw.items():
    key = str(key)
    if key in NESTED_SECTIONS:
      if not isinstance(value, Mapping):
        raise ConfigError(f"config key '{key}' ({where}) must be a mapping such as {{enable_lora: true}}, not {echo(value)}; or set {key}.<key>=value")
      for sub, v in value.items():
        flat.update(flatten({f"{key}.{sub}": v}, where))
      continue
    if key == "base_config":
      raise ConfigError(f"base_config ({where}) can only be set inside a YAML file, as 'base_config: parent.yml'")
    if key not in known and not maxtext_keys.may_accept(key, value):
      raise unknown_key_error(key, where)
    flat[key] = value
  return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, value in flat.items():
    if "." in key:
      head, tail = key.split(".", 1)
      out.setdefault(head, {})[tail] = value
    else:
      out[key] = value
  return out
