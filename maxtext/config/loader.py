"""Turn `<config.yml> key=value ...` into a validated, frozen MaxTextConfig.

Order (later wins): YAML file with its `base_config:` chain, then
configs/models/<model_name>.yml, then command-line `key=value`, then `M_<KEY>`
environment variables. Every value remembers where it came from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from maxtext.config import derived, maxtext_keys, paths
from maxtext.config.keys import NESTED_SECTIONS, Sources, all_keys, flatten, unknown_key_error
from maxtext.config.maxtext_config import DERIVED_KEYS, MaxTextConfig
from maxtext.config.model_file import PACKAGE_CONFIG_DIR, check_family, check_model_file, merged_axis_rules, model_file_path
from maxtext.config.overrides import env_name, overridden_source, parse_cli, parse_env
from maxtext.config.validate import validate
from maxtext.config.yaml_files import read_yaml
from maxtext.errors import ConfigError, echo


class SourceMap(dict):
  """Sources of a loaded config, plus `maxtext_only`: the MaxText keys it set that have no effect here, with their values."""

  def __init__(self, *args: Any):
    super().__init__(*args)
    self.maxtext_only: dict[str, Any] = {}


def _load_yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> tuple[dict[str, Any], Sources]:
  path = path.resolve() if path.exists() else path
  if path in seen:
    raise ConfigError(f"config file '{path}' includes itself through base_config; break the cycle")
  data = read_yaml(path)
  values: dict[str, Any] = {}
  sources: Sources = {}
  parent = data.pop("base_config", None)
  if parent is not None:
    if not isinstance(parent, str) or not parent:
      raise ConfigError(f"base_config in '{path}' must be a file name, got {echo(parent)}")
    parent_path = Path(parent) if Path(parent).is_absolute() else path.parent / parent
    values, sources = _load_yaml_chain(parent_path, seen + (path,))
  own = flatten(data, f"in {path.name}")
  values.update(own)
  sources.update({k: str(path.name) for k in own})
  return values, sources


DeviceCounts = Callable[[MaxTextConfig], tuple[int, int]]  # the user config -> (num_devices, num_slices)


def _platform_device_counts(config: MaxTextConfig) -> tuple[int, int]:
  from maxtext import platform  # platform sits below config: it reads config keys without importing this package

  return platform.device_counts(config)


def load_with_sources(
  argv: Sequence[str],
  env: Mapping[str, str] | None = None,
  num_devices: int | None = None,
  num_slices: int | None = None,
  devices: DeviceCounts | None = None,
) -> tuple[MaxTextConfig, Sources]:
  """Load a config and report where each value came from.

  argv: [config.yml, key=value, ...]. env defaults to os.environ. num_devices and num_slices default to the AOT
  topology when compile_topology is set, else to devices(user_config) -> (num_devices, num_slices): entry points
  pass maxtext.process.prepare, which sets up the process and counts JAX's devices. Without it the counts come from
  maxtext.platform.device_counts, which does not start JAX: loading a config never initialises a backend.
  """
  if not argv:
    raise ConfigError("no config file given; usage: python -m maxtext.<entry> configs/base.yml key=value ...")
  env = os.environ if env is None else env
  config_path = Path(argv[0])
  if "=" in argv[0] and not config_path.is_file():
    raise ConfigError(f"the first argument must be a YAML config file, got '{argv[0]}'; usage: python -m maxtext.<entry> configs/base.yml key=value ...")
  values, sources = _load_yaml_chain(config_path)
  cli, overridden = parse_cli(argv[1:])
  env_values = parse_env(env)

  for key in sorted(set(cli) & set(env_values)):
    raise ConfigError(f"config key '{key}' is set both on the command line and by environment variable {env_name(key)}; set it once")

  model_name = env_values.get("model_name", cli.get("model_name", values.get("model_name", "default")))
  if model_name is not None and str(model_name) != "default":
    model_path = model_file_path(str(model_name), config_path)
    model_raw = read_yaml(model_path)
    check_family(model_raw, {"decoder_block": f"models/{model_path.name}"})
    check_model_file(model_raw, model_path)
    model_values = flatten(model_raw, f"in models/{model_path.name}")
    override = env_values.get("override_model_config", cli.get("override_model_config", values.get("override_model_config", False)))
    if override not in (True, "true", "True"):
      for key, value in {**cli, **env_values}.items():
        if key in model_values and value != model_values[key]:
          raise ConfigError(
            f"'{key}={value}' conflicts with '{key}: {model_values[key]}' in models/{model_path.name}; pass override_model_config=true to override model values"
          )
    if "logical_axis_rules" in model_values:  # as in MaxText, a model file's rules update the rules by name
      model_values["logical_axis_rules"] = merged_axis_rules(values.get("logical_axis_rules"), model_values["logical_axis_rules"], model_path)
    values.update(model_values)
    sources.update({k: f"models/{model_path.name}" for k in model_values})

  values.update(cli)
  sources.update({k: overridden_source(k, overridden[k]) if k in overridden else "command line" for k in cli})
  values.update(env_values)
  sources.update({k: f"env {env_name(k)}" for k in env_values})
  from maxtext.convert.hf_architecture import apply_architecture, is_hf_dir  # a Hugging Face directory's config.json sets the architecture

  if is_hf_dir(values.get("load_parameters_path")):
    apply_architecture(str(values["load_parameters_path"]), values, sources, "base.yml")
  sources = SourceMap(sources)
  check_family(values, sources)
  known = set(all_keys())
  for key in [k for k in values if k not in known]:  # MaxText keys without effect: listed, then dropped
    value = values.pop(key)
    if maxtext_keys.is_default(key, value):
      sources[key] = f"{sources[key]}; {maxtext_keys.NOT_IMPLEMENTED}"
    elif maxtext_keys.matches_built_in(key, value, values):
      sources[key] = f"{sources[key]}; {maxtext_keys.BUILT_IN}"
    else:
      raise unknown_key_error(key, f"in {sources[key]}" if sources[key].endswith(".yml") else sources[key])
    sources.maxtext_only[key] = value
  user = validate(values, sources)

  counts = devices(user) if devices is not None else None  # runs even for AOT: it prepares the process
  if num_devices is None and not user.compile_topology:
    num_devices, num_slices = counts or _platform_device_counts(user)
  updates = derived.compute(user, num_devices=num_devices, num_slices=num_slices)
  config = user.model_copy(update=updates)
  for key in all_keys():
    sources.setdefault(key, "default")
  for key, value in updates.items():
    if key in NESTED_SECTIONS or key in paths.PATH_KEYS or key in paths.GLOB_KEYS:
      continue  # a path made absolute keeps the source the user set it in
    if key in DERIVED_KEYS or value != getattr(user, key):
      sources[key] = "derived"
  return config, sources


def load(
  argv: Sequence[str],
  env: Mapping[str, str] | None = None,
  num_devices: int | None = None,
  num_slices: int | None = None,
  devices: DeviceCounts | None = None,
) -> MaxTextConfig:
  """Load, validate and derive a MaxTextConfig; raises ConfigError with a one-line message."""
  return load_with_sources(argv, env, num_devices, num_slices, devices)[0]


def from_overrides(
  base: str | Path = PACKAGE_CONFIG_DIR / "base.yml", env: Mapping[str, str] | None = None, num_devices: int | None = None, **overrides: Any
) -> MaxTextConfig:
  """Python API: load base.yml with keyword overrides (nested keys as lora={'enable_lora': True})."""
  args = [str(base)]
  for key, value in overrides.items():
    if isinstance(value, Mapping):
      args += [f"{key}.{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}" for k, v in value.items()]
    else:
      args.append(f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
  return load(args, env={} if env is None else env, num_devices=num_devices)
