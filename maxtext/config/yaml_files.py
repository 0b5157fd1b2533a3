"""A YAML text or file read safely: safe tags only, `1e-5` as a float, and refused in one line when larger than a config can be."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from maxtext.errors import ConfigError

# What one YAML text may expand to. A config is a few hundred keys: MaxText's own base.yml is 92 KB and 2,000 nodes.
MAX_YAML_CHARS = 256 * 1024
MAX_YAML_NODES = 20_000  # after aliases are expanded (a 10-level alias "bomb" expands to 10**10)
MAX_YAML_DEPTH = 64  # nested collections


class _YamlLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when installed: 20x faster
  """Safe YAML loader that also reads `1e-5` (no dot) as a float, as users expect."""


_YamlLoader.add_implicit_resolver(
  "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def yaml_load(text: str, where: str) -> Any:
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


def read_yaml(path: Path) -> dict[str, Any]:
  if not path.is_file():
    raise ConfigError(f"config file '{path}' not found; pass the path of a YAML file such as configs/base.yml")
  try:
    with path.open(encoding="utf-8") as f:
      text = f.read(MAX_YAML_CHARS + 1)  # a longer file is refused without reading the rest
    data = yaml_load(text, f"config file '{path}'")
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
