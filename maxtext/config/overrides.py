"""The command line's `key=value` arguments and the `M_<KEY>` environment variables, parsed to typed values."""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from maxtext.config import maxtext_keys
from maxtext.config.keys import all_keys, flatten, schema_field, unknown_key_error
from maxtext.config.yaml_files import yaml_load
from maxtext.errors import ConfigError, echo

ENV_PREFIX = "M_"


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
  field = schema_field(key) if key else None
  if field is not None and text in typing.get_args(field.annotation) and typing.get_origin(field.annotation) is typing.Literal:
    return text  # a Literal choice is taken as typed: remat_policy=none is the policy 'none'
  if text.strip().lower() in ("none", "null", "~"):
    return None
  try:
    value = yaml_load(text, f"the value of '{key}'" if key else "a command-line value") if text.strip() else text
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


def parse_cli(args: Sequence[str]) -> tuple[dict[str, Any], Overridden]:
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
  return flatten(out, "on the command line"), overridden


def overridden_source(key: str, earlier: list[str]) -> str:
  """The source of a key given more than once on the command line: 'command line (given 2 times, the last wins; earlier: steps=1)'."""
  shown = ", ".join(f"{key}={t if t.isprintable() and len(t) <= 60 else echo(t, 60)}" for t in earlier)
  return f"command line (given {len(earlier) + 1} times, the last wins; earlier: {shown})"


def env_name(key: str) -> str:
  """The environment variable that sets a key: M_STEPS, M_LORA__ENABLE_LORA."""
  return ENV_PREFIX + key.upper().replace(".", "__")


def parse_env(env: Mapping[str, str]) -> dict[str, Any]:
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
      raise unknown_key_error(guess, f"from environment variable {name}")
    out[key] = parse_cli_value(text, key)
  return out
