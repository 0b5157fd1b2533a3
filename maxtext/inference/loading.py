"""What decode runs on: the model (own checkpoint, load_parameters_path, a Hugging Face directory, base + LoRA)
and its tokenizer, checked before anything is compiled."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import yaml
from flax import nnx
from jax.sharding import Mesh

from maxtext import models, platform
from maxtext.config import MaxTextConfig, load
from maxtext.errors import ConfigError, DataError
from maxtext.models.decoder import Transformer
from maxtext.platform import Policy
from maxtext.tokenizer import Tokenizer, load_tokenizer


def hf_config(argv: Sequence[str], hf_dir: str, **load_kwargs) -> MaxTextConfig:
  """The run's config with the architecture of the Hugging Face directory; keys set in argv win."""
  from maxtext.convert.hf_config import read_overrides

  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    raise ConfigError(f"hf_model_path '{hf_dir}' holds no config.json; pass a Hugging Face model directory (config.json + *.safetensors)")
  given = {a.split("=", 1)[0].strip() for a in argv[1:]}
  arch = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}" for k, v in read_overrides(hf_dir).items()]
  return load([argv[0], *(a for a in arch if a.split("=", 1)[0] not in given), *argv[1:]], **load_kwargs)


def serving_policy(config: MaxTextConfig, mesh: Mesh) -> Policy:
  """The mesh's platform policy, with quantized kernels held quantized (loaded so, or quantized on load)."""
  policy = platform.resolve(config, mesh)
  return policy if policy.quantization is None else dataclasses.replace(policy, quantization=policy.quantization.storing())


def check_save_path(config: MaxTextConfig) -> None:
  """save_quantized_params_path names a new directory in a writable place; checked before anything is loaded,
  computed or written (Orbax refuses an existing directory only when it writes, after the whole load)."""
  from etils import epath

  from maxtext.train import outputs

  path = config.save_quantized_params_path
  if not path:
    return
  if epath.Path(path).exists():
    raise outputs.OutputError(f"save_quantized_params_path '{path}' already exists; name a new directory (nothing was overwritten)")
  outputs.check_writable(path, 0, "save_quantized_params_path")


def load_model(config: MaxTextConfig, mesh: Mesh, log: Callable[[str], None] = print, policy: Policy | None = None) -> Transformer:
  """The model to decode with, its parameters sharded over mesh; with `quantization`, its kernels stored quantized.

  Sources, first that applies: hf_model_path; else load_parameters_path (plus lora.lora_restore_path); else the
  run's own latest checkpoint (<base_output_directory>/<run_name>/checkpoints). With lora.enable_lora and no
  lora.lora_restore_path, the run's own checkpoint supplies the adapters over load_parameters_path's base.
  save_quantized_params_path: the loaded (quantized) parameters are also written there as a params checkpoint.
  policy: the platform policy to build with (default: serving_policy; benchmarks pass a variant of it).
  """
  check_save_path(config)
  model = _load(config, mesh, policy or serving_policy(config, mesh), log)
  if config.save_quantized_params_path:
    from maxtext.train.checkpoint_files import save_params

    save_params(config.save_quantized_params_path, nnx.state(model, nnx.Param))
    log(f"wrote the {config.quantization} parameters to {config.save_quantized_params_path} (load them with checkpoint_is_quantized=true)")
  return model


def _load(config: MaxTextConfig, mesh: Mesh, policy: Policy, log: Callable[[str], None]) -> Transformer:
  from maxtext.convert.peft import _abstract_params

  if config.hf_model_path:
    from maxtext.convert.model_params import model_from_flat
    from maxtext.hf import params_from_hf

    log(f"loading Hugging Face model {config.hf_model_path}")
    return model_from_flat(config, params_from_hf(config.hf_model_path, config), mesh, policy)
  from maxtext.train.checkpoint_files import item_path, latest_saved_step
  from maxtext.train.initial_params import load_initial_params

  own = latest_saved_step(config.checkpoint_dir)
  updates = {}
  if config.lora.enable_lora and not config.lora.lora_restore_path and own:
    updates["lora"] = config.lora.model_copy(update={"lora_restore_path": own})
  elif not config.lora.enable_lora and not config.load_parameters_path:
    if own is None:
      raise ConfigError(
        f"no checkpoint to decode: '{config.checkpoint_dir}' holds none; set load_parameters_path=<run>/checkpoints/<step>, "
        "hf_model_path=<dir>, or the run_name and base_output_directory of a trained run"
      )
    updates["load_parameters_path"] = own
  if config.lora.enable_lora and not (config.load_parameters_path or updates.get("lora", config.lora).lora_restore_path):
    raise ConfigError("lora.enable_lora=true needs the base (load_parameters_path) and the adapters (lora.lora_restore_path or the run's own checkpoint)")
  config = config.model_copy(update=updates)  # paths are absolute: the config resolved them, checkpoint_dir included
  for path in (config.load_parameters_path, config.lora.lora_restore_path):
    if path:
      item_path(path)  # a missing path fails here, before any parameter is allocated
  model = models.create_sharded(config, mesh, policy=policy)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = load_initial_params(config, params, _abstract_params(config, policy, mesh), log)  # restored onto mesh, not the default devices
  return nnx.merge(graphdef, params, rest)


def load_decode_tokenizer(config: MaxTextConfig) -> Tokenizer:
  """tokenizer_path; with an HF model and no tokenizer_path, the directory's own; with dataset_type=embedded, the cached
  corpus tokenizer training made. A tokenizer with more tokens than the model's vocabulary is a DataError."""
  from maxtext.data import embedded

  path, kind = config.tokenizer_path, config.tokenizer_type
  if not path and config.hf_model_path:
    path, kind = config.hf_model_path, "huggingface"
  if not path and config.dataset_type == "embedded":
    path = embedded.tokenizer_cache_path(config.base_output_directory, embedded.tokenizer_size(config))
    if not os.path.exists(path):
      raise DataError(f"no tokenizer at '{path}' (training caches it there); set tokenizer_path or base_output_directory to the training run's")
  tokenizer = load_tokenizer(kind, path)
  from maxtext.inference.generate import check_tokenizer

  check_tokenizer(tokenizer, config.vocab_size)
  return tokenizer
