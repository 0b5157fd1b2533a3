"""A user config validated by the schema, where a MaxText default that the schema rejects stands for this project's default."""

from __future__ import annotations

from typing import Any

import pydantic
import yaml

from maxtext.config import maxtext_keys
from maxtext.config.keys import NESTED_SECTIONS, Sources, schema_field, unflatten, unknown_key_error
from maxtext.config.maxtext_config import MaxTextConfig
from maxtext.errors import ConfigError, echo


def _format_validation_error(err: pydantic.ValidationError, sources: Sources) -> ConfigError:
  first = err.errors()[0]
  loc = [str(p) for p in first["loc"]]
  key = loc[0] if loc else "?"
  if key in NESTED_SECTIONS and len(loc) > 1:
    key = f"{key}.{loc[1]}"
  where = sources.get(key, "default")
  value = first.get("input")
  msg = first["msg"]
  if first["type"] == "extra_forbidden":
    return unknown_key_error(key, where)
  return ConfigError(f"invalid value for '{key}' ({where}): {echo(value)}; {msg[0].lower() + msg[1:]}")


# Keys whose values name MaxText's mesh axes (stage, context, fsdp_transpose, ...): MaxText's default value means
# this project's default, the same strategies over the axes implemented here.
MAXTEXT_AXIS_KEYS = ("mesh_axes", "logical_axis_rules", "data_sharding")


def _maxtext_default_as_ours(key: str, values: dict[str, Any], sources: Sources) -> bool:
  """Replace a MaxText default that this schema reads differently by this project's default; False if it is not one."""
  if key not in values or schema_field(key) is None or not maxtext_keys.is_default(key, values[key]):
    return False
  sources[key] = (
    f"{sources.get(key, 'default')}; MaxText's default {yaml.safe_dump(values[key], default_flow_style=True, width=60).strip()[:40]}... read as this project's default"
  )
  del values[key]
  return True


def validate(values: dict[str, Any], sources: Sources) -> MaxTextConfig:
  """The schema-validated user config; a MaxText default the schema rejects (compile_topology_num_slices: -1,
  max_num_checkpoints_to_keep: 'None', MaxText's axis names) stands for this project's default."""
  for key in MAXTEXT_AXIS_KEYS:
    value = values.get(key)
    if value is not None and value != schema_field(key).get_default(call_default_factory=True):
      _maxtext_default_as_ours(key, values, sources)
  while True:
    try:
      return MaxTextConfig.model_validate(unflatten(values))
    except pydantic.ValidationError as e:
      loc = [str(p) for p in e.errors()[0]["loc"]]
      key = f"{loc[0]}.{loc[1]}" if loc and loc[0] in NESTED_SECTIONS and len(loc) > 1 else (loc[0] if loc else "")
      if not _maxtext_default_as_ours(key, values, sources):
        raise _format_validation_error(e, sources) from None
