"""Every check a run can fail, done before it writes anything (no directory, lock, checkpoint or metrics writer).

`run_checks(config, mesh, setup) -> Checked`, cheapest first: hardware and eval settings, the model (abstract
build) and the adamw_mask patterns against its parameters, restore paths (load_parameters_path,
load_full_state_path, lora.lora_restore_path, the run's own checkpoints), room in the output locations, the data
sources and tokenizer (the train iterator is opened; the eval one is opened and closed), the compiled train step
and, with evals, the compiled eval step, and whether they fit the device memory.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import jax

from maxtext import memory_limit, platform
from maxtext import mesh as mesh_lib
from maxtext.aot import memory, remat_auto
from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError, gib
from maxtext.train import checkpoint_files, checkpointing, initial_params, outputs
from maxtext.train import setup as setup_lib
from maxtext.train import state as state_lib


@dataclasses.dataclass
class Checked:
  config: MaxTextConfig  # remat_policy=auto and decoder_layer_input=auto replaced by what the compiled memory chose
  mesh: jax.sharding.Mesh
  setup: setup_lib.TrainSetup
  step_fn: Any  # the compiled train step
  data_iter: Any  # the train iterator, at its start
  checkpoint_bytes: int  # size of one checkpoint of the train state
  choice: remat_auto.Choice | None = None  # how the auto keys were resolved here (None: not auto, or by train_compile)
  trainer: Any = None  # GRPO: the rollout-score-update driver (maxtext.train.grpo.Trainer) that runs each step


def run_checks(
  config: MaxTextConfig, mesh: jax.sharding.Mesh | None = None, setup: setup_lib.TrainSetup | None = None, log: Callable[[str], None] | None = None
) -> Checked:
  platform.check_hardware(config)
  check_quantization(config)
  if config.eval_interval > 0 and config.eval_steps <= 0 and config.dataset_type == "synthetic":
    raise ConfigError(f"eval_steps={config.eval_steps} evaluates the whole eval split, but synthetic data never ends; set eval_steps to a positive number")
  if config.use_grpo:  # a reward function that does not import fails before anything is built
    from maxtext.train import rewards

    rewards.load(config.grpo_reward_functions, config.grpo_reward_weights)
  mesh = setup.mesh if setup is not None else mesh or mesh_lib.create(config)
  choice = None
  if config.compiled_trainstep_file:  # the auto keys take what train_compile chose; the stamp check compares the rest
    from maxtext.aot import executable

    config = executable.with_compiled_choices(config.compiled_trainstep_file, config)
  elif setup is None:
    config, choice = remat_auto.resolve(config, mesh, setup_lib.build, log=log)  # the compiled memory picks the policy and the place
    chosen = remat_auto.chosen_step(choice)  # compiled while choosing
    setup = chosen.setup if chosen is not None else None
  setup = setup or setup_lib.build(config, mesh)
  check_adamw_mask(config, setup.abstract_state["params"])
  checkpointed = state_lib.checkpointed(setup.abstract_state, config)
  check_restore_paths(config, setup, checkpointed)

  checkpoint_bytes = memory.state_bytes(checkpointed)
  check_outputs(config, checkpoint_bytes)

  from maxtext.data import create_iterator

  data_iter = create_iterator(config, mesh, "train")
  notes = list(getattr(data_iter, "notes", []))
  if config.eval_interval > 0:
    eval_iter = create_iterator(config, mesh, "eval")
    notes += getattr(eval_iter, "notes", [])
    close_iterator(eval_iter)
  for note in notes if log is not None else ():
    log(note)

  with jax.set_mesh(mesh):  # traced as the loop would run it
    step_fn = compiled_step(config, setup, mesh)
  check_memory_fit(config, step_fn)
  if config.eval_interval > 0:
    check_eval_memory_fit(config, setup)
  trainer = None
  if config.use_grpo:  # reward functions imported, tokenizer loaded, rollout decoder built
    from maxtext.train import grpo

    trainer = grpo.prepare(config, setup, step_fn, data_iter)
  return Checked(config, mesh, setup, step_fn, data_iter, checkpoint_bytes, choice, trainer)


def check_quantization(config: MaxTextConfig) -> None:
  """Quantization keys that training cannot honour: weight-only int4 on trained kernels, decode-only keys."""
  if config.quantization == "int4w" and not config.lora.enable_lora:
    raise ConfigError(
      "quantization=int4w stores frozen kernels in int4, but training without LoRA updates every kernel; set lora.enable_lora=true (QLoRA) or use int8, fp8 or fp8_full"
    )
  if config.quantize_kvcache:
    raise ConfigError("quantize_kvcache=true quantizes the decoding KV cache; training keeps none: drop it here and pass it to python -m maxtext.decode")
  if config.save_quantized_params_path:
    raise ConfigError(
      "save_quantized_params_path is written by python -m maxtext.decode (quantize a checkpoint once, then decode from it); drop it from training"
    )


def check_adamw_mask(config: MaxTextConfig, params: Any) -> None:
  """Each adamw_mask pattern finds at least one trained parameter: one that finds none would exempt nothing, silently."""
  if not config.adamw_mask:
    return
  if config.opt_type == "sgd":
    raise ConfigError("adamw_mask exempts parameters from weight decay, which opt_type=sgd does not apply; drop adamw_mask")
  from maxtext.train import optimizers, trainable

  paths = optimizers.parameter_paths(trainable.split_params(params, config)[0])
  for pattern in config.adamw_mask:
    if not any(re.search(pattern, path) for path in paths):
      examples = ", ".join(repr(p) for p in [p for p in paths if not p.endswith(optimizers.NO_DECAY_NAMES)][:3])
      raise ConfigError(
        f"adamw_mask pattern {pattern!r} finds no trained parameter's path, so it exempts nothing from weight decay; paths look like {examples}; fix or drop it"
      )


def check_outputs(config: MaxTextConfig, checkpoint_bytes: int) -> None:
  """Every output location is a (future) directory we may write, with room for one checkpoint."""
  if config.enable_checkpointing:
    outputs.check_writable(config.checkpoint_dir, checkpoint_bytes, "checkpoint_dir")
  outputs.check_writable(os.path.dirname(config.checkpoint_dir.rstrip("/")), 0, "the run directory")
  if config.enable_checkpointing and (config.enable_emergency_checkpoint or config.enable_multi_tier_checkpointing):
    outputs.check_writable(config.local_checkpoint_directory, checkpoint_bytes, "local_checkpoint_directory")
    outputs.check_can_make(config.local_checkpoint_directory, "local_checkpoint_directory")
  if config.metrics_file:
    outputs.check_writable(config.metrics_file, 0, "metrics_file", is_file=True)
  if config.enable_tensorboard or config.profiler == "xplane":
    outputs.check_writable(config.tensorboard_dir, 0, "tensorboard_dir")


def close_iterator(it: Any) -> None:
  """Stop a data iterator's prefetch threads and workers (synthetic iterators have none)."""
  if hasattr(it, "close"):
    it.close()


def check_restore_paths(config: MaxTextConfig, setup: setup_lib.TrainSetup, checkpointed: Any) -> None:
  """Every checkpoint the run may read matches this model; read metadata only, no arrays."""
  from flax import nnx

  from maxtext.layers.lora import LoRAParam
  from maxtext.layers.mhc import MHCParam

  params = setup.abstract_state["params"]
  from maxtext.convert import hf_dir

  if hf_dir.is_hf_dir(config.load_parameters_path):
    hf_dir.check(config.load_parameters_path, config, nnx.filter_state(initial_params.base_target(config, params), nnx.Not(nnx.Any(LoRAParam, MHCParam))))
  elif config.load_parameters_path:
    initial_params.check_base_quantization(config, config.load_parameters_path, params)
    target = initial_params.base_target(config, params)
    checkpoint_files.match_params(config.load_parameters_path, target, "load_parameters_path", may_lack=nnx.Any(LoRAParam, MHCParam))
  if config.lora.lora_restore_path:
    if not config.lora.enable_lora:
      raise ConfigError(f"lora.lora_restore_path='{config.lora.lora_restore_path}' needs lora.enable_lora=true")
    wanted = nnx.filter_state(params, nnx.Any(LoRAParam, MHCParam))
    checkpoint_files.match_params(config.lora.lora_restore_path, wanted, "lora.lora_restore_path", may_lack=MHCParam)
  settings = checkpointing.settings_of(config)
  if config.load_full_state_path:
    item = checkpoint_files.item_path(config.load_full_state_path)
    problem = checkpointing.check_compatible(item, checkpointed, config.load_full_state_path, settings)
    if problem:
      raise ConfigError(f"load_full_state_path '{config.load_full_state_path}' is not a usable checkpoint ({problem}); pass another step directory")
    checkpointing.check_lora_base(config, item.parent, "load_full_state_path")
  if config.enable_checkpointing:
    newest = checkpoint_files.newest_step_dir(config.checkpoint_dir)
    if newest is not None:  # a damaged newest step is set aside at restore; another train state's checkpoints stop here
      checkpointing.check_compatible(newest / checkpoint_files.ITEM, checkpointed, config.checkpoint_dir, settings)
      checkpointing.check_lora_base(config, newest, "the run's checkpoint")


def compiled_step(config: MaxTextConfig, setup: setup_lib.TrainSetup, mesh: jax.sharding.Mesh) -> Any:
  """The train step the loop runs: the AOT executable of compiled_trainstep_file, else setup's compiled step."""
  if config.compiled_trainstep_file:  # made by maxtext.train_compile; refused unless config and devices match
    from maxtext.aot import executable

    return executable.load(config.compiled_trainstep_file, config, list(mesh.devices.flat))
  return setup.compiled_step


def memory_remedy(config: MaxTextConfig) -> str:
  """The keys that lower a train step's memory, as a clause of a one-line error."""
  remat = "" if config.remat_policy == "full" else "use remat_policy=full, "
  return f"lower per_device_batch_size ({config.per_device_batch_size}) or max_target_length ({config.max_target_length}), {remat}or shard over more devices"


def eval_memory_remedy(config: MaxTextConfig) -> str:
  """The keys that lower an eval batch's memory, as a clause of a one-line error."""
  rows = (
    f"lower eval_per_device_batch_size ({config.eval_per_device_batch_size})"
    if config.eval_per_device_batch_size
    else f"set eval_per_device_batch_size below per_device_batch_size ({config.per_device_batch_size})"
  )
  return f"{rows}, lower max_target_length ({config.max_target_length}), or shard over more devices"


def check_eval_memory_fit(config: MaxTextConfig, setup: setup_lib.TrainSetup) -> None:
  """The compiled eval step, beside the rest of the train state (optimizer state: a run or maxtext.eval holds the whole
  state while it evaluates), within memory.MEMORY_HEADROOM of what a device may use; compiled here, reused by the evals."""
  with jax.set_mesh(setup.mesh), memory_limit.one_line("compiling the eval step", eval_memory_remedy(config)):
    compiled = setup.compiled_eval(config.global_batch_size_to_eval_on)
  sizes = memory.step_bytes(compiled)
  if sizes is None:
    return
  need, temp = sizes
  state = setup.abstract_state
  beside = memory.shard_bytes(state, device_only=True) - memory.shard_bytes(setup.eval_arguments(state), device_only=True)
  limit = memory_limit.limit_per_device()
  if need + beside > memory.MEMORY_HEADROOM * limit.bytes:
    raise ConfigError(
      f"the compiled eval step needs {need / 2**30:.2f} GiB per device ({temp / 2**30:.2f} GiB of it temporaries), beside {gib(beside)} "
      f"of optimizer state, but {limit.what} leaves {limit.bytes / 2**30:.2f} GiB per device; {eval_memory_remedy(config)}"
    )


def check_memory_fit(config: MaxTextConfig, compiled: Any) -> None:
  """The compiled step's memory within memory.MEMORY_HEADROOM of what a device may use (maxtext.memory_limit: on CPU the
  smallest of the host's available memory, the cgroup limit, RLIMIT_AS and RLIMIT_DATA)."""
  sizes = memory.step_bytes(compiled)
  if sizes is None:
    return
  need, temp = sizes
  limit = memory_limit.limit_per_device()
  if need > memory.MEMORY_HEADROOM * limit.bytes:
    raise ConfigError(
      f"the compiled train step needs {need / 2**30:.2f} GiB per device ({temp / 2**30:.2f} GiB of it temporaries) but {limit.what} "
      f"leaves {limit.bytes / 2**30:.2f} GiB per device; {memory_remedy(config)}"
    )
