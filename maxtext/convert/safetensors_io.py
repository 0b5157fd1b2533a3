"""Read and write Hugging Face model directories (config.json + one or more safetensors files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from maxtext.errors import ConfigError

INDEX = "model.safetensors.index.json"


def read_config(hf_dir: str | Path) -> dict[str, Any]:
  path = Path(hf_dir) / "config.json"
  if not path.is_file():
    raise ConfigError(f"'{path}' not found; pass a Hugging Face model directory holding config.json and *.safetensors")
  return read_json_object(path, "fix or re-download the file")


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
  """The JSON object (a dict) in path; anything else is a one-line ConfigError ending with `fix`."""
  try:
    value = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"'{path}' is not valid JSON (line {e.lineno}); {fix}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"'{path}' cannot be read ({type(e).__name__}); {fix}") from None
  if not isinstance(value, dict):
    raise ConfigError(f"'{path}' holds a JSON {type(value).__name__}, not an object of settings; {fix}")
  return value


def read_tensors(hf_dir: str | Path) -> dict[str, np.ndarray]:
  """All tensors of the directory's safetensors files (bfloat16 is read as float32 exactly); a tensor stored in two
  files is a one-line ConfigError (which copy is meant cannot be told)."""
  d = Path(hf_dir)
  index = d / INDEX
  if index.is_file():
    weight_map = read_json_object(index, "fix or re-download the file").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
      raise ConfigError(f"'{index}' has no weight_map of tensor names to file names; fix or re-download the file")
    files = sorted({d / f for f in weight_map.values()})
  else:
    files = sorted(d.glob("*.safetensors"))
  if not files:
    raise ConfigError(f"no *.safetensors files in '{d}'; convert .bin checkpoints to safetensors first")
  tensors: dict[str, np.ndarray] = {}
  origin: dict[str, Path] = {}
  for f in files:
    loaded = _load(f)
    twice = sorted(set(loaded) & set(tensors))
    if twice:
      raise ConfigError(f"tensor '{twice[0]}' is stored in both '{origin[twice[0]]}' and '{f}'; remove the stray file (the directory mixes two checkpoints?)")
    tensors.update(loaded)
    origin.update(dict.fromkeys(loaded, f))
  return tensors


def _load(path: Path) -> dict[str, np.ndarray]:
  """The file's tensors; a truncated or corrupt file is a one-line ConfigError naming it."""
  try:
    try:
      return load_file(str(path))
    except (TypeError, ValueError):  # dtypes numpy lacks (bfloat16): read through JAX, which keeps them exactly
      from safetensors import safe_open

      with safe_open(str(path), framework="flax") as f:
        return {k: np.asarray(f.get_tensor(k)) for k in f.keys()}
  except (SafetensorError, OSError, ValueError, TypeError) as e:
    reason = " ".join(str(e).split())[:160] or type(e).__name__
    raise ConfigError(f"'{path}' is not a readable safetensors file ({reason}); it may be truncated or corrupt: re-download or re-export it") from None


def write(hf_dir: str | Path, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
  d = Path(hf_dir)
  d.mkdir(parents=True, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
  (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
