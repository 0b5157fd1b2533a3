"""Save and load a compiled train step, stamped with the config and devices it was compiled for.

Loading unpickles an XLA executable: it is the one place in maxtext that deserialises executable
code, so only load files you made yourself (see docs/tpu.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Sequence
from typing import Any

import jax
from jax.experimental import serialize_executable

from maxtext.config import MaxTextConfig
from maxtext.config.sections import AOT, Checkpointing, DatasetGeneral, Distributed, Tokenizer
from maxtext.errors import ConfigError

MAGIC = b"maxtext-compiled-train-step v1\n"
AUTO_KEYS = ("remat_policy", "decoder_layer_input")  # 'auto' values train_compile resolves before compiling

# Keys that cannot change the compiled step: where outputs go, logging, data sources, how processes meet.
_RUN_ONLY_KEYS = {
  "run_name",
  "model_name",
  "override_model_config",
  "base_output_directory",
  "hardware",
  "log_period",
  "enable_tensorboard",
  "metrics_file",
  "init_weights_seed",
  "device_peak_tflops",
  "steps",  # the schedule length is kept as learning_rate_schedule_steps
  "eval_interval",
  "eval_steps",
  "target_eval_loss",
  "profiler",
  "profiler_steps",
  "skip_first_n_steps_for_profiler",
  "checkpoint_dir",
  "tensorboard_dir",
}
for _section in (AOT, Checkpointing, DatasetGeneral, Distributed, Tokenizer):
  _RUN_ONLY_KEYS.update(_section.model_fields)


def step_config(config: MaxTextConfig) -> dict[str, Any]:
  """The config values the compiled step depends on, JSON-ready."""
  return {k: v for k, v in config.model_dump(mode="json").items() if k not in _RUN_ONLY_KEYS}


def fingerprint(config: MaxTextConfig) -> str:
  return hashlib.sha256(json.dumps(step_config(config), sort_keys=True).encode()).hexdigest()[:16]


def device_facts(devices: Sequence[jax.Device]) -> dict[str, Any]:
  return {
    "device_kind": devices[0].device_kind,
    "num_devices": len(devices),
    "num_slices": len({getattr(d, "slice_index", 0) or 0 for d in devices}),
  }


def _header(config: MaxTextConfig, devices: Sequence[jax.Device]) -> dict[str, Any]:
  return {"fingerprint": fingerprint(config), "jax": jax.__version__, **device_facts(devices), "config": step_config(config)}


def save(path: str, compiled: jax.stages.Compiled, config: MaxTextConfig, devices: Sequence[jax.Device]) -> None:
  """Write the executable and its stamp; the file appears complete or not at all."""
  payload, in_tree, out_tree = serialize_executable.serialize(compiled)
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    raise ConfigError(f"compiled_trainstep_file '{path}': directory {directory} does not exist; create it or choose another path")
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(MAGIC)
    f.write(json.dumps(_header(config, devices), sort_keys=True).encode() + b"\n")
    pickle.dump((payload, in_tree, out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
  os.replace(tmp, path)


def read_header(path: str) -> dict[str, Any]:
  try:
    with open(path, "rb") as f:
      magic, line = f.readline(), f.readline()
  except OSError as e:
    raise ConfigError(f"compiled_trainstep_file '{path}' cannot be read ({e.strerror}); run maxtext.train_compile with this setting first") from None
  if magic != MAGIC:
    raise ConfigError(f"compiled_trainstep_file '{path}' is not a maxtext compiled train step; make it with python -m maxtext.train_compile")
  return json.loads(line)


def with_compiled_choices(path: str, config: MaxTextConfig) -> MaxTextConfig:
  """config with each AUTO_KEYS value 'auto' replaced by the value the file was compiled with (train_compile resolved
  it for the same config; `check` still compares everything)."""
  compiled = read_header(path)["config"]
  return config.model_copy(update={k: compiled[k] for k in AUTO_KEYS if getattr(config, k) == "auto" and k in compiled})


def check(path: str, config: MaxTextConfig, devices: Sequence[jax.Device]) -> None:
  """Raise a one-line ConfigError unless the file was compiled for this config and these devices."""
  header, want = read_header(path), _header(config, devices)
  if header["jax"] != want["jax"]:
    raise ConfigError(f"compiled_trainstep_file '{path}' was compiled with jax {header['jax']}, this is jax {want['jax']}; recompile it with train_compile")
  facts = ("device_kind", "num_devices", "num_slices")
  if any(header[k] != want[k] for k in facts):
    had = ", ".join(f"{k}={header[k]}" for k in facts)
    has = ", ".join(f"{k}={want[k]}" for k in facts)
    raise ConfigError(
      f"compiled_trainstep_file '{path}' was compiled for {had} but this run has {has}; recompile for these devices or unset compiled_trainstep_file"
    )
  if header["fingerprint"] != want["fingerprint"]:
    old, new = header["config"], want["config"]
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:3]) + (", ..." if len(diff) > 3 else "")
    raise ConfigError(
      f"compiled_trainstep_file '{path}' was compiled for a different config ({shown}); recompile with train_compile or unset compiled_trainstep_file"
    )


def load(path: str, config: MaxTextConfig, devices: Sequence[jax.Device]) -> jax.stages.Compiled:
  """The compiled step in `path`, after checking its stamp against config and devices (unpickles trusted code)."""
  check(path, config, devices)
  with open(path, "rb") as f:
    f.readline(), f.readline()
    payload, in_tree, out_tree = pickle.load(f)
  return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
