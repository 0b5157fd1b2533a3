"""Turn `<config.yml> key=value ...` into a validated, frozen MaxTextConfig.

Order (later wins): YAML file with its `base_config:` chain, then
configs/models/<model_name>.yml, then command-line `key=value`, then `M_<KEY>`
environment variables. Every value remembers where it came from.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from maxtext.config import derived, maxtext_keys
from maxtext.config.maxtext_config import DERIVED_KEYS, MaxTextConfig
from maxtext.errors import ConfigError, echo

ENV_PREFIX = "M_"
PACKAGE_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
NESTED_SECTIONS = {"lora": MaxTextConfig.model_fields["lora"].annotation}

# key -> where its value came from; filled for every key of the final config.
Sources = dict[str, str]


class SourceMap(dict):
  """Sources of a loaded config, plus `maxtext_only`: the MaxText keys it set that have no effect here, with their values."""

  def __init__(self, *args: Any):
    super().__init__(*args)
    self.maxtext_only: dict[str, Any] = {}


# What one YAML text may expand to. A config is a few hundred keys: MaxText's own base.yml is 92 KB and 2,000 nodes.
MAX_YAML_CHARS = 256 * 1024
MAX_YAML_NODES = 20_000  # after aliases are expanded (a 10-level alias "bomb" expands to 10**10)
MAX_YAML_DEPTH = 64  # nested collections


class _YamlLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when installed: 20x faster
  """Safe YAML loader that also reads `1e-5` (no dot) as a float, as users expect."""


_YamlLoader.add_implicit_resolver(
  "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def _yaml_load(text: str, where: str) -> Any:
  """The value of a YAML text (safe tags only), refused in one line when it is larger than a config can be: more
  than MAX_YAML_CHARS characters, MAX_YAML_DEPTH levels of nesting or MAX_YAML_NODES nodes once aliases are expanded.
  Each check runs before the next stage can take long (parser events in C, then the node graph, then the values)."""
  fix = "a config holds plain settings; write the value out or load large data from a file key"
  if len(text) > MAX_YAML_CHARS:
    raise ConfigError(f"{where} is longer than a config may be ({MAX_YAML_CHARS} characters); {fix}")
  depth = nodes = 0
  for event in yaml.parse(text, Loader=_YamlLoader):
    if isinstance(event, yaml.CollectionStartEvent):
      depth += 1
      if depth > MAX_YAML_DEPTH:
        raise ConfigError(f"{where} nests collections more than {MAX_YAML_DEPTH} levels deep; {fix}")
    elif isinstance(event, yaml.CollectionEndEvent):
      depth -= 1
    nodes += isinstance(event, yaml.NodeEvent)
    if nodes > MAX_YAML_NODES:
      raise ConfigError(f"{where} holds more than {MAX_YAML_NODES} values; {fix}")
  loader = _YamlLoader(text)
  try:
    node = loader.get_single_node()
    if node is None:
      return None
    if _expanded_nodes(node, {}, set()) > MAX_YAML_NODES:
      raise ConfigError(f"{where} expands to more than {MAX_YAML_NODES} values through YAML aliases (*name); {fix}")
    return loader.construct_document(node)
  finally:
    loader.dispose()


def _expanded_nodes(node: yaml.Node, counted: dict[int, int], open_nodes: set[int]) -> int:
  """How many nodes `node` stands for once every alias is replaced by what it names (each shared node counted once)."""
  key = id(node)
  if key in counted:
    return counted[key]
  if key in open_nodes:  # an alias to an enclosing node: a value that contains itself
    return MAX_YAML_NODES + 1
  open_nodes.add(key)
  children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
  total = 1 + sum(_expanded_nodes(child, counted, open_nodes) for child in children)
  open_nodes.discard(key)
  counted[key] = total
  return total


def _field(key: str) -> Any:
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


def _unknown_key_error(key: str, where: str) -> ConfigError:
  if key in DERIVED_KEYS:
    return ConfigError(f"config key '{key}' ({where}) is derived and cannot be set; see `python -m maxtext.config` for what it is computed from")
  if maxtext_keys.is_maxtext_key(key):
    default = maxtext_keys.defaults()[key]
    accepted = f"only its MaxText default {default!r} is accepted (it has no effect)" if maxtext_keys.is_default(key, default) else "no value is accepted"
    return ConfigError(f"config key '{key}' ({where}) is a MaxText option this project does not implement; {accepted}; remove it")
  close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
  hint = f" (did you mean '{close[0]}'?)" if close else ""
  return ConfigError(f"unknown config key '{key}'{hint} {where}")


def _flatten(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
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
        flat.update(_flatten({f"{key}.{sub}": v}, where))
      continue
    if key == "base_config":
      raise ConfigError(f"base_config ({where}) can only be set inside a YAML file, as 'base_config: parent.yml'")
    if key not in known and not maxtext_keys.may_accept(key, value):
      raise _unknown_key_error(key, where)
    flat[key] = value
  return flat


def _read_yaml(path: Path) -> dict[str, Any]:
  if not path.is_file():
    raise ConfigError(f"config file '{path}' not found; pass the path of a YAML file such as configs/base.yml")
  try:
    with path.open(encoding="utf-8") as f:
      text = f.read(MAX_YAML_CHARS + 1)  # a longer file is refused without reading the rest
    data = _yaml_load(text, f"config file '{path}'")
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}" if mark else ""
    raise ConfigError(f"config file '{path}' is not valid YAML{at}: {getattr(e, 'problem', e)}; fix the file") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"config file '{path}' cannot be read ({e.__class__.__name__}); check the path and permissions") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"config file '{path}' must hold a mapping of key: value, not {type(data).__name__}")
  return data


def _load_yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> tuple[dict[str, Any], Sources]:
  path = path.resolve() if path.exists() else path
  if path in seen:
    raise ConfigError(f"config file '{path}' includes itself through base_config; break the cycle")
  data = _read_yaml(path)
  values: dict[str, Any] = {}
  sources: Sources = {}
  parent = data.pop("base_config", None)
  if parent is not None:
    if not isinstance(parent, str) or not parent:
      raise ConfigError(f"base_config in '{path}' must be a file name, got {echo(parent)}")
    parent_path = Path(parent) if Path(parent).is_absolute() else path.parent / parent
    values, sources = _load_yaml_chain(parent_path, seen + (path,))
  own = _flatten(data, f"in {path.name}")
  values.update(own)
  sources.update({k: str(path.name) for k in own})
  return values, sources


def _check_utf8(text: str, what: str) -> None:
  """Refuse text the OS could not decode as UTF-8: Python keeps each undecodable byte as a lone surrogate
  (U+DC80..U+DCFF), which no encoder (YAML, file names, logs) accepts later."""
  bad = next((i for i, ch in enumerate(text) if "\udc80" <= ch <= "\udcff"), None)
  if bad is not None:
    raise ConfigError(f"{what} is not valid UTF-8 (byte 0x{ord(text[bad]) - 0xDC00:02x} at character {bad + 1}); pass UTF-8 text")


def parse_cli_value(text: str, key: str | None = None) -> Any:
  """YAML typing for command-line values; 'none' (any case) is None.

  For a string-typed key a value that YAML reads as a number or bool stays the
  text the user typed (`run_name=2024` is the name '2024', not an int; a line break or tab is kept, not folded), and a
  value spelled like one of a Literal key's choices is that choice.
  """
  _check_utf8(text, f"the value of '{key}'" if key else "a command-line value")
  field = _field(key) if key else None
  if field is not None and text in typing.get_args(field.annotation) and typing.get_origin(field.annotation) is typing.Literal:
    return text  # a Literal choice is taken as typed: remat_policy=none is the policy 'none'
  if text.strip().lower() in ("none", "null", "~"):
    return None
  try:
    value = _yaml_load(text, f"the value of '{key}'" if key else "a command-line value") if text.strip() else text
  except yaml.YAMLError:
    return text
  quoted = text.lstrip()[:1] in ("'", '"')  # a quoted YAML string means what YAML reads (from_overrides writes these)
  if field is not None and field.annotation is str and (isinstance(value, bool | int | float) or (not quoted and any(c in text for c in "\n\r\t\0"))):
    return text  # a number stays the text typed; so does an unquoted line break, which YAML would fold into a space
  if field is not None and field.annotation is str and not quoted and isinstance(value, dict | list):
    return text  # prompt=Question: what is -- a string key's text, not the YAML mapping (or list) it would spell
  return value


# key -> the values given before the last one, for keys given more than once on the command line (the last wins)
Overridden = dict[str, list[str]]


def _parse_cli(args: Sequence[str]) -> tuple[dict[str, Any], Overridden]:
  """(values, overridden): a key given more than once takes its last value, as in MaxText (OmegaConf), where
  scripts append overrides to a base command line; `overridden` keeps the earlier texts for the sources."""
  out: dict[str, Any] = {}
  texts: dict[str, str] = {}
  overridden: Overridden = {}
  for arg in args:
    if "=" not in arg:
      _check_utf8(arg, f"command-line argument {echo(arg)}")
      raise ConfigError(f"command-line argument '{arg}' is not key=value; write e.g. steps=100")
    key, text = arg.split("=", 1)
    key = key.strip()
    _check_utf8(key, f"the key of command-line argument {echo(arg)}")
    if not key or any(c.isspace() for c in key):
      raise ConfigError(f"command-line argument '{arg}' is not key=value; write e.g. steps=100")
    _check_utf8(text, f"the value of '{key}' on the command line")
    if key in out:
      overridden.setdefault(key, []).append(texts[key])
      del out[key]  # the last one also takes the last place, as if given once
    texts[key] = text
    out[key] = parse_cli_value(text, key)
  return _flatten(out, "on the command line"), overridden


def overridden_source(key: str, earlier: list[str]) -> str:
  """The source of a key given more than once on the command line: 'command line (given 2 times, the last wins; earlier: steps=1)'."""
  shown = ", ".join(f"{key}={t if t.isprintable() and len(t) <= 60 else echo(t, 60)}" for t in earlier)
  return f"command line (given {len(earlier) + 1} times, the last wins; earlier: {shown})"


def env_name(key: str) -> str:
  """The environment variable that sets a key: M_STEPS, M_LORA__ENABLE_LORA."""
  return ENV_PREFIX + key.upper().replace(".", "__")


def _parse_env(env: Mapping[str, str]) -> dict[str, Any]:
  by_env_name = {env_name(k): k for k in all_keys()}
  out: dict[str, Any] = {}
  for name, text in env.items():
    if not name.startswith(ENV_PREFIX):
      continue
    _check_utf8(name, f"environment variable name {echo(name)}")
    _check_utf8(text, f"the value of environment variable {name}")
    key = by_env_name.get(name)
    if key is None:
      guess = name[len(ENV_PREFIX) :].lower().replace("__", ".")
      if maxtext_keys.is_default(guess, parse_cli_value(text)):
        continue  # a MaxText key at its default has no effect
      raise _unknown_key_error(guess, f"from environment variable {name}")
    out[key] = parse_cli_value(text, key)
  return out


def _model_file(model_name: str, config_path: Path) -> Path:
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


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, value in flat.items():
    if "." in key:
      head, tail = key.split(".", 1)
      out.setdefault(head, {})[tail] = value
    else:
      out[key] = value
  return out


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
    return _unknown_key_error(key, where)
  return ConfigError(f"invalid value for '{key}' ({where}): {echo(value)}; {msg[0].lower() + msg[1:]}")


# Keys whose values name MaxText's mesh axes (stage, context, fsdp_transpose, ...): MaxText's default value means
# this project's default, the same strategies over the axes implemented here.
MAXTEXT_AXIS_KEYS = ("mesh_axes", "logical_axis_rules", "data_sharding")


def _maxtext_default_as_ours(key: str, values: dict[str, Any], sources: Sources) -> bool:
  """Replace a MaxText default that this schema reads differently by this project's default; False if it is not one."""
  if key not in values or _field(key) is None or not maxtext_keys.is_default(key, values[key]):
    return False
  sources[key] = (
    f"{sources.get(key, 'default')}; MaxText's default {yaml.safe_dump(values[key], default_flow_style=True, width=60).strip()[:40]}... read as this project's default"
  )
  del values[key]
  return True


def _merged_axis_rules(base: Any, update: Any, model_path: Path) -> list[list[Any]]:
  """The rules `base` (this project's default when unset or MaxText's default) with the model file's rules replacing
  or adding rules by logical name; MaxText's `[name, 'axis']` is `[name, ['axis']]`."""
  if base is None or maxtext_keys.is_default("logical_axis_rules", base):
    base = _field("logical_axis_rules").get_default(call_default_factory=True)
  if not isinstance(update, list) or not all(isinstance(r, list | tuple) and len(r) == 2 for r in update):
    raise ConfigError(f"logical_axis_rules in models/{model_path.name} must be a list of [logical_name, [mesh axes]]; fix the file")
  rules = {str(name): list(axes) for name, axes in base}
  for name, axes in update:
    rules[str(name)] = [axes] if isinstance(axes, str) else list(axes)
  return [[name, axes] for name, axes in rules.items()]


def _validate(values: dict[str, Any], sources: Sources) -> MaxTextConfig:
  """The schema-validated user config; a MaxText default the schema rejects (compile_topology_num_slices: -1,
  max_num_checkpoints_to_keep: 'None', MaxText's axis names) stands for this project's default."""
  for key in MAXTEXT_AXIS_KEYS:
    value = values.get(key)
    if value is not None and value != _field(key).get_default(call_default_factory=True):
      _maxtext_default_as_ours(key, values, sources)
  while True:
    try:
      return MaxTextConfig.model_validate(_unflatten(values))
    except pydantic.ValidationError as e:
      loc = [str(p) for p in e.errors()[0]["loc"]]
      key = f"{loc[0]}.{loc[1]}" if loc and loc[0] in NESTED_SECTIONS and len(loc) > 1 else (loc[0] if loc else "")
      if not _maxtext_default_as_ours(key, values, sources):
        raise _format_validation_error(e, sources) from None


def _check_family(values: Mapping[str, Any], sources: Sources) -> None:
  """An unbuilt decoder_block is the cause, named before any key of its family that this schema lacks (MaxText's gpt3
  files' trainable_position_size): one line naming the families built here."""
  from maxtext.models import registry  # the config loads before any model code otherwise

  block = values.get("decoder_block")
  if isinstance(block, str) and block not in registry.FAMILIES:
    raise ConfigError(
      f"invalid value for 'decoder_block' ({sources.get('decoder_block', 'default')}): {echo(block)}; this project does not build that family; "
      f"the families built here: {', '.join(registry.FAMILIES)}"
    )


def _check_model_file(model: Mapping[str, Any], model_path: Path) -> None:
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
  cli, overridden = _parse_cli(argv[1:])
  env_values = _parse_env(env)

  for key in sorted(set(cli) & set(env_values)):
    raise ConfigError(f"config key '{key}' is set both on the command line and by environment variable {env_name(key)}; set it once")

  model_name = env_values.get("model_name", cli.get("model_name", values.get("model_name", "default")))
  if model_name is not None and str(model_name) != "default":
    model_path = _model_file(str(model_name), config_path)
    model_raw = _read_yaml(model_path)
    _check_family(model_raw, {"decoder_block": f"models/{model_path.name}"})
    _check_model_file(model_raw, model_path)
    model_values = _flatten(model_raw, f"in models/{model_path.name}")
    override = env_values.get("override_model_config", cli.get("override_model_config", values.get("override_model_config", False)))
    if override not in (True, "true", "True"):
      for key, value in {**cli, **env_values}.items():
        if key in model_values and value != model_values[key]:
          raise ConfigError(
            f"'{key}={value}' conflicts with '{key}: {model_values[key]}' in models/{model_path.name}; pass override_model_config=true to override model values"
          )
    if "logical_axis_rules" in model_values:  # as in MaxText, a model file's rules update the rules by name
      model_values["logical_axis_rules"] = _merged_axis_rules(values.get("logical_axis_rules"), model_values["logical_axis_rules"], model_path)
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
  _check_family(values, sources)
  known = set(all_keys())
  for key in [k for k in values if k not in known]:  # MaxText keys without effect: listed, then dropped
    value = values.pop(key)
    if maxtext_keys.is_default(key, value):
      sources[key] = f"{sources[key]}; {maxtext_keys.NOT_IMPLEMENTED}"
    elif maxtext_keys.matches_built_in(key, value, values):
      sources[key] = f"{sources[key]}; {maxtext_keys.BUILT_IN}"
    else:
      raise _unknown_key_error(key, f"in {sources[key]}" if sources[key].endswith(".yml") else sources[key])
    sources.maxtext_only[key] = value
  user = _validate(values, sources)

  counts = devices(user) if devices is not None else None  # runs even for AOT: it prepares the process
  if num_devices is None and not user.compile_topology:
    num_devices, num_slices = counts or _platform_device_counts(user)
  updates = derived.compute(user, num_devices=num_devices, num_slices=num_slices)
  config = user.model_copy(update=updates)
  for key in all_keys():
    sources.setdefault(key, "default")
  for key, value in updates.items():
    if key in NESTED_SECTIONS or key in derived.PATH_KEYS or key in derived.GLOB_KEYS:
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
