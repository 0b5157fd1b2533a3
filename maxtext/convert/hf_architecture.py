"""A Hugging Face directory's config.json as the architecture of a run's config (maxtext.config.loader applies it
when load_parameters_path names such a directory). It reads config.json alone: no weights, no model, no MaxTextConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from maxtext.convert.hf_config import read_overrides
from maxtext.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
NOT_ARCHITECTURE = ("dtype",)  # config.json's storage dtype: the run's dtype stays its own (as hf-to-maxtext leaves it)


def is_hf_dir(path: Any) -> bool:
  """A local directory holding config.json and at least one *.safetensors file (a checkpoint directory holds neither)."""
  if not isinstance(path, str | Path) or not str(path) or "://" in str(path):
    return False
  p = Path(path)
  return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def _same(given: Any, value: Any) -> bool:
  if isinstance(value, list | tuple) and isinstance(given, list | tuple):
    return len(given) == len(value) and all(_same(g, v) for g, v in zip(given, value))
  if isinstance(value, bool) or isinstance(given, bool):
    return given is value or str(given).lower() == str(value).lower()
  if isinstance(value, int | float) and isinstance(given, int | float):
    return abs(float(given) - float(value)) <= 1e-9 * max(1.0, abs(float(value)))
  return given == value or str(given) == str(value)


def apply_architecture(hf_dir: str, values: dict[str, Any], sources: dict[str, str], defaults_file: str) -> None:
  """Set values' architecture keys from hf_dir's config.json (the source naming it). A key set elsewhere than
  defaults_file (the package's base.yml) to another value is a one-line ConfigError; tokenizer_path, when empty,
  becomes the directory (tokenizer_type huggingface) if it holds tokenizer files."""
  source = f"{hf_dir}/config.json"
  arch = {k: v for k, v in read_overrides(hf_dir).items() if k not in NOT_ARCHITECTURE}
  for key, value in arch.items():
    where = sources.get(key, "default")
    if where not in ("default", defaults_file) and key in values and not _same(values[key], value):
      raise ConfigError(
        f"'{key}={values[key]}' ({where}) contradicts {source}, which gives {key}={value}; "
        f"drop {key} (load_parameters_path's config.json sets the architecture) or point load_parameters_path at the right model"
      )
  if sources.get("model_name", "default") not in ("default", defaults_file) and str(values.get("model_name", "default")) != "default":
    raise ConfigError(
      f"model_name={values['model_name']} and load_parameters_path={hf_dir} (a Hugging Face directory) both set the architecture; drop model_name"
    )
  values.update(arch)
  sources.update(dict.fromkeys(arch, source))
  if not values.get("tokenizer_path") and any((Path(hf_dir) / f).is_file() for f in TOKENIZER_FILES):
    values["tokenizer_path"], values["tokenizer_type"] = str(Path(hf_dir).absolute()), "huggingface"
    sources["tokenizer_path"] = sources["tokenizer_type"] = source.removesuffix("/config.json")
