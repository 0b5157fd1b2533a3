"""Local paths made absolute once, when a config loads, and the run name checked as one directory name."""

from __future__ import annotations

import os
import unicodedata
from typing import TYPE_CHECKING, Any

from maxtext.errors import ConfigError, echo

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig


# Keys naming one local file or directory, and keys holding comma-separated globs: made absolute once, here,
# so a relative path means the same thing to every library (Orbax refuses relative checkpoint paths).
PATH_KEYS = (
  "base_output_directory",
  "metrics_file",
  "load_parameters_path",
  "load_full_state_path",
  "dataset_path",
  "tokenizer_path",
  "chat_template_path",
  "compiled_trainstep_file",
  "save_quantized_params_path",
  "grain_train_mixture_config_path",
  "eval_harness_include_path",
  "local_checkpoint_directory",
)


GLOB_KEYS = ("grain_train_files", "grain_eval_files", "hf_train_files", "hf_eval_files")
NESTED_PATH_KEYS = (("lora", "lora_restore_path"),)


def absolute_path(path: str) -> str:
  """A local path made absolute against the working directory ('~' expanded); URIs (gs://, s3://, ...) and '' unchanged."""
  if not path or "://" in path:
    return path
  absolute = os.path.abspath(os.path.expanduser(path))
  return absolute + os.sep if path.endswith(("/", os.sep)) and not absolute.endswith(os.sep) else absolute


def absolute_globs(value: str) -> str:
  """Comma-separated globs made absolute; in a mixture ('globs,weight;globs,weight') each component's globs."""
  if ";" in value:
    parts = []
    for part in value.split(";"):
      globs, comma, weight = part.rpartition(",")
      parts.append(absolute_globs(globs) + comma + weight if comma else absolute_globs(part))
    return ";".join(parts)
  return ",".join(absolute_path(part.strip()) for part in value.split(",")) if value else value


MAX_RUN_NAME_BYTES = 200  # a directory name (file systems allow 255 bytes), leaving room for what tools append


def check_run_name(name: str) -> None:
  """A run name is one directory name: not '.' or '..', no '/', no control characters, at most MAX_RUN_NAME_BYTES."""
  size = len(name.encode("utf-8", "surrogatepass"))
  if size > MAX_RUN_NAME_BYTES:
    raise ConfigError(f"invalid value for 'run_name': {echo(name, 60)} is {size} bytes long; use a name of at most {MAX_RUN_NAME_BYTES} bytes")
  bad = next((ch for ch in name if ch == os.sep or unicodedata.category(ch) == "Cc"), None)
  if bad is not None or name in (".", ".."):
    what = f"contains {bad!r}" if bad is not None else "is not a name"
    raise ConfigError(f"invalid value for 'run_name': {echo(name)} {what}; use a plain name without '/' or control characters (newline, tab, NUL)")


def _check_path(key: str, value: str) -> None:
  bad = next((ch for ch in value if unicodedata.category(ch) == "Cc"), None)
  if bad is not None:
    raise ConfigError(f"invalid value for '{key}': {echo(value)} contains the control character {bad!r}; remove it")


def resolve_paths(c: MaxTextConfig) -> dict[str, Any]:
  """Updates that make every local path key absolute (only the keys whose value changes); a control character
  (NUL, newline, ...) in a path is a ConfigError."""
  updates: dict[str, Any] = {}
  for key in PATH_KEYS:
    value = getattr(c, key)
    _check_path(key, value)
    if absolute_path(value) != value:
      updates[key] = absolute_path(value)
  for key in GLOB_KEYS:
    value = getattr(c, key)
    _check_path(key, value)
    resolved = absolute_globs(value)
    if resolved != value:
      updates[key] = resolved
  for section, key in NESTED_PATH_KEYS:
    sub = getattr(c, section)
    value = getattr(sub, key)
    _check_path(f"{section}.{key}", value)
    if absolute_path(value) != value:
      updates[section] = sub.model_copy(update={key: absolute_path(value)})
  return updates
