"""Derived config values and cross-field checks, computed in one place (the mesh degrees and the pipeline and
context checks in maxtext.config.parallelism)."""

from __future__ import annotations

import datetime
import importlib.util
import math
import os
import re
import unicodedata
from typing import TYPE_CHECKING, Any

from maxtext.config.adapters import adapter_specs
from maxtext.config.parallelism import PARALLEL_AXES, axis_size, check_context, check_diloco, diloco_axes, fill_parallelism, parallelism_key, pipeline_values
from maxtext.errors import ConfigError, echo
from maxtext.quantization_recipe import QUANTIZATION_CALIBRATION_KEYS

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
GRADIENT_QUANTIZED = ("fp8", "fp8_full")  # modes whose backward products quantize the incoming gradient
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


def scale_dims(global_parameter_scale: int) -> dict[str, int]:
  """Multipliers for layers, heads/mlp and emb from global_parameter_scale = 2^k."""
  scale = global_parameter_scale
  if scale < 1 or scale & (scale - 1):
    raise ConfigError(f"invalid value for 'global_parameter_scale': {scale}; it must be a power of two (1, 2, 4, 8, ...)")
  q, r = divmod(int(math.log2(scale)), 3)
  return {"layers": 2**q, "heads": 2 ** (q + (r > 0)), "emb": 2 ** (q + (r > 1))}


def _layer_shape(c: MaxTextConfig) -> MaxTextConfig:
  """c with the layer count it derives: num_decoder_layers is written only after the checks, and a family's layer
  pattern reads it."""
  return c.model_copy(update={"num_decoder_layers": c.base_num_decoder_layers * scale_dims(c.global_parameter_scale)["layers"]})


def _mixers(c: MaxTextConfig) -> set[str]:
  """The token mixers of the family's layer pattern."""
  from maxtext.models import registry  # the config loads before any model code otherwise

  return registry.get(c.decoder_block).mixers(_layer_shape(c))


def _device_counts(config: MaxTextConfig, num_devices: int | None, num_slices: int | None) -> tuple[int, int]:
  """The counts given, else the AOT topology's; loading a config never asks JAX (the loader passes its counts)."""
  if num_devices is not None:
    return num_devices, num_slices or 1
  if config.compile_topology:
    from maxtext import topology

    topo = topology.parse(config.compile_topology)
    return topo.chips * config.compile_topology_num_slices, config.compile_topology_num_slices
  raise ValueError("derived.compute needs num_devices unless compile_topology is set")


def _check_cross_fields(c: MaxTextConfig, heads: int, kv_heads: int) -> None:
  if c.lora.max_lora_adapters > 1 or c.lora.lora_adapters:
    adapter_specs(c)  # validates names, ranks and their count
  if c.lora.adapter_column:
    if not (c.lora.enable_lora and c.lora.max_lora_adapters > 1):
      raise ConfigError(
        f"lora.adapter_column='{c.lora.adapter_column}' picks one of several adapters per document; set lora.enable_lora=true and lora.max_lora_adapters > 1, or drop it"
      )
    if c.dataset_type == "synthetic":
      raise ConfigError("lora.adapter_column reads a column of the data records; dataset_type=synthetic has none, use a file dataset or drop it")
  if c.enable_wandb and importlib.util.find_spec("wandb") is None:
    raise ConfigError("enable_wandb=true needs the wandb package; pip install 'maxtext[wandb]' (or wandb), or set enable_wandb=false")
  if heads % kv_heads:
    raise ConfigError(f"num_query_heads {heads} is not a multiple of num_kv_heads {kv_heads}; change base_num_query_heads or base_num_kv_heads")
  if c.num_experts_per_tok > c.num_experts:
    raise ConfigError(f"num_experts_per_tok {c.num_experts_per_tok} > num_experts {c.num_experts}; lower num_experts_per_tok")
  _check_moe_fields(c)
  _check_quantization(c)
  _check_post_training(c)
  _check_family_fields(c)
  _check_indexer(c)
  _check_llama4_fields(c)
  _check_vision_training(c)
  if c.load_parameters_path and c.load_full_state_path and not c.lora.enable_lora:  # LoRA: the frozen base under the state's adapters
    raise ConfigError("load_parameters_path and load_full_state_path are both set; set only one (load_parameters_path= clears it)")
  if c.learning_rate_schedule_steps != -1 and c.learning_rate_schedule_steps < 1:
    raise ConfigError(f"invalid value for 'learning_rate_schedule_steps': {c.learning_rate_schedule_steps}; use -1 (= steps) or a positive integer")
  if c.max_num_checkpoints_to_keep is not None and c.max_num_checkpoints_to_keep < 1:
    raise ConfigError(
      f"invalid value for 'max_num_checkpoints_to_keep': {c.max_num_checkpoints_to_keep}; it would delete every checkpoint; use a positive number or leave it unset to keep all"
    )
  for key, pattern in [("lora.lora_module_path", c.lora.lora_module_path)] + [("adamw_mask", p) for p in c.adamw_mask]:
    try:
      re.compile(pattern)
    except re.error as e:
      raise ConfigError(f"invalid value for '{key}': {pattern!r} is not a regular expression ({e}); fix the pattern") from None
  if c.lr_schedule_type == "wsd" and c.warmup_steps_fraction + c.wsd_decay_steps_fraction > 1:
    raise ConfigError("warmup_steps_fraction + wsd_decay_steps_fraction > 1; lower one of them")
  unknown_axes = [a for a in c.mesh_axes if a not in PARALLEL_AXES]
  if unknown_axes or len(set(c.mesh_axes)) != len(c.mesh_axes):
    raise ConfigError(f"invalid mesh_axes {c.mesh_axes}; use each of {list(PARALLEL_AXES)} at most once")
  for name, axes in c.logical_axis_rules:
    missing = [a for a in axes if a not in c.mesh_axes]
    if missing:
      raise ConfigError(f"logical_axis_rules maps '{name}' to {missing}, not in mesh_axes {c.mesh_axes}; fix one of the two")
  missing = [a for a in c.data_sharding if a not in c.mesh_axes]
  if missing:
    raise ConfigError(f"data_sharding names {missing}, not in mesh_axes {c.mesh_axes}; fix one of the two")


def _check_local_tier(c: MaxTextConfig) -> None:
  """The local checkpoint tier's keys: a directory and a positive period when it is on (docs/checkpointing.md)."""
  interval = c.multi_tier_checkpointing_backup_interval_minutes
  if interval is not None and not c.enable_multi_tier_checkpointing:
    raise ConfigError("multi_tier_checkpointing_backup_interval_minutes applies only with enable_multi_tier_checkpointing=true; set it or drop the interval")
  if interval is not None and interval <= 0:
    raise ConfigError(f"invalid value for 'multi_tier_checkpointing_backup_interval_minutes': {interval}; use a positive number of minutes (or null: none)")
  if not (c.enable_emergency_checkpoint or c.enable_multi_tier_checkpointing):
    return
  which = "enable_multi_tier_checkpointing" if c.enable_multi_tier_checkpointing else "enable_emergency_checkpoint"
  if c.local_checkpoint_period <= 0:
    raise ConfigError(f"invalid value for 'local_checkpoint_period': {c.local_checkpoint_period}; {which}=true needs a positive number of steps")
  if not c.local_checkpoint_directory:
    raise ConfigError(f"{which}=true needs local_checkpoint_directory (a directory on each host's own disk)")
  if not c.enable_checkpointing:
    raise ConfigError(f"{which}=true adds a local tier to the persistent checkpoints; set enable_checkpointing=true")


def _check_quantization(c: MaxTextConfig) -> None:
  """Cross-field checks of the quantization keys (one-line ConfigErrors)."""
  for key in QUANTIZATION_CALIBRATION_KEYS:
    value = getattr(c, key)
    problem = calibration_problem(value)
    if problem:
      raise ConfigError(f"invalid value for '{key}': {echo(value)} {problem}; use absmax, absmax,<c> or rms,<c> (c > 0), fixed,<c> or fixed,-<c>,<c>")
    if value != "absmax" and c.quantization != "fp8_full":
      raise ConfigError(f"{key}={value} applies to quantization=fp8_full (int8, fp8 and int4w scale by absmax each step); set quantization=fp8_full or drop it")
  shards = c.quantization_local_shard_count
  if shards == 0 or shards < -1:
    raise ConfigError(f"invalid value for 'quantization_local_shard_count': {shards}; use -1 (one per slice) or a positive number")
  if shards != -1 and (not c.quantization or c.quantization not in GRADIENT_QUANTIZED):
    raise ConfigError(
      f"quantization_local_shard_count={shards} tiles the quantized weight gradients of fp8 and fp8_full; "
      f"quantization='{c.quantization}' keeps gradients in {c.dtype}: drop it"
    )
  if c.quantize_logits_proj and c.quantization in ("", "int4w"):
    raise ConfigError(
      f"quantize_logits_proj=true quantizes the output projection's weights and activations; quantization='{c.quantization}' does not (use int8, fp8 or fp8_full)"
    )
  if c.checkpoint_is_quantized and not (c.quantization and c.load_parameters_path):
    raise ConfigError(
      "checkpoint_is_quantized=true loads quantized kernels from load_parameters_path; set load_parameters_path and the quantization they were saved with"
    )
  if c.save_quantized_params_path and not c.quantization:
    raise ConfigError("save_quantized_params_path writes kernels quantized per `quantization`, which is off; set quantization=int8, fp8, fp8_full or int4w")
  if c.quantize_kvcache:
    if not c.kv_quant_axis:
      raise ConfigError("quantize_kvcache=true needs kv_quant_axis=dkv or heads_and_dkv (the axes one scale covers); set it")
    if c.kv_quant_dtype == "int4" and c.head_dim % 2:
      raise ConfigError(f"kv_quant_dtype=int4 stores two values per byte along head_dim, which is odd ({c.head_dim}); use kv_quant_dtype=int8")
    if {"mla", "mla_sparse"} & _mixers(c):
      raise ConfigError(
        f"quantize_kvcache=true quantizes keys and values per kv head; decoder_block={c.decoder_block} (MLA) caches a compressed latent,"
        " which stays in the compute dtype here; drop quantize_kvcache"
      )


def calibration_problem(method: str) -> str | None:
  """What is wrong with a qwix calibration method for fp8 ('absmax', 'absmax,c', 'rms,c', 'fixed,c', 'fixed,lo,hi'), or None.

  Every factor is a finite number > 0 (qwix takes absmax,-3 and scales by a negative or zero absmax, which it quietly
  replaces by 1); a fixed range holds 0 and is symmetric, since fp8 has no zero point (qwix refuses others mid-run)."""
  name, *args = method.split(",")
  try:
    numbers = [float(a) for a in args]
  except ValueError:
    return "has a factor that is not a number"
  counts = {"absmax": (0, 1), "rms": (1,), "fixed": (1, 2)}
  if name not in counts:
    return "is not a calibration method"
  if len(numbers) not in counts[name]:
    return f"gives {name} {len(numbers)} factors"
  if not all(math.isfinite(x) for x in numbers):
    return "has a factor that is not finite"
  if name != "fixed" or len(numbers) == 1:
    return None if all(x > 0 for x in numbers) else "has a factor that is not > 0"
  lo, hi = numbers
  return None if lo == -hi and hi > 0 else f"is not a range [-c, c] around 0 (fp8 scales are symmetric: {lo} .. {hi})"


def _check_quantization_tiles(config: MaxTextConfig, tiles: int) -> None:
  """The weight gradient's token axis (each row's max_target_length tokens) must split into `tiles` equal tiles."""
  if tiles > 1 and config.max_target_length % tiles:
    raise ConfigError(
      f"quantization_local_shard_count {tiles} must divide max_target_length {config.max_target_length} (the weight gradient's token axis); pick a divisor"
    )


def _check_moe_fields(c: MaxTextConfig) -> None:
  """DeepSeek MoE, MLA, YaRN and MTP keys that only make sense together."""
  groups, topk_groups = c.n_routing_groups, c.topk_routing_group
  if (groups == -1) != (topk_groups == -1):
    raise ConfigError(f"n_routing_groups {groups} and topk_routing_group {topk_groups} must both be -1 (off) or both positive; set both")
  if groups != -1:
    if groups < 1 or c.num_experts % groups or not 1 <= topk_groups <= groups:
      raise ConfigError(
        f"group-limited routing needs n_routing_groups dividing num_experts {c.num_experts} and 1 <= topk_routing_group <= n_routing_groups; got {groups}, {topk_groups}"
      )
    if c.num_experts // groups < 2:
      raise ConfigError(
        f"group-limited routing scores each group by its top-2 experts, but {c.num_experts} experts in {groups} groups leave fewer than 2 per group"
      )
  if c.capacity_factor != -1 and c.capacity_factor <= 0:
    raise ConfigError(f"invalid value for 'capacity_factor': {c.capacity_factor}; use -1 (dropless) or a positive number")
  if c.ragged_buffer_factor != -1 and c.ragged_buffer_factor <= 0:
    raise ConfigError(f"invalid value for 'ragged_buffer_factor': {c.ragged_buffer_factor}; use -1 (worst-case buffer, dropless) or a positive number")
  if c.num_experts > 1 and c.sparse_matmul and c.megablox and c.use_tokamax_gmm and importlib.util.find_spec("tokamax") is None:
    raise ConfigError("use_tokamax_gmm=true needs the tokamax package; pip install tokamax (or the `tpu` extra), or set use_tokamax_gmm=false")
  if c.routed_bias_update_rate > 0 and not c.routed_bias:
    raise ConfigError("routed_bias_update_rate > 0 updates the routing bias, but routed_bias is false; set routed_bias=true")
  if c.base_moe_mlp_dim != -1 and c.base_moe_mlp_dim < 1:
    raise ConfigError(f"invalid value for 'base_moe_mlp_dim': {c.base_moe_mlp_dim}; use -1 (= base_mlp_dim) or a positive integer")
  moe_only = {"shared_experts": c.shared_experts, "first_num_dense_layers": c.first_num_dense_layers, "n_routing_groups": max(groups, 0)}
  if c.num_experts == 1 and any(moe_only.values()):
    raise ConfigError(f"{', '.join(k for k, v in moe_only.items() if v)} need experts, but num_experts is 1; set num_experts > 1")
  if c.first_num_dense_layers >= c.base_num_decoder_layers * scale_dims(c.global_parameter_scale)["layers"]:
    raise ConfigError(f"first_num_dense_layers {c.first_num_dense_layers} leaves no MoE layer; lower it below the number of decoder layers")
  if c.routed_bias_update_rate > 0 and c.routed_score_func not in ("sigmoid", "sqrtsoftplus"):
    raise ConfigError(
      "routed_bias_update_rate > 0 moves a score-correction bias, which needs routed_score_func=sigmoid or sqrtsoftplus (with softmax scores routed_bias is a trained router bias)"
    )
  if c.mlp_bias and c.num_experts == 1:
    raise ConfigError("mlp_bias adds biases to routed experts, but num_experts is 1 (dense MLPs have none here); set num_experts > 1 or mlp_bias=false")
  if c.decoder_block in ("deepseek", "deepseek_v32") and (c.kv_lora_rank < 1 or c.qk_rope_head_dim < 2 or c.qk_rope_head_dim % 2 or c.v_head_dim < 1):
    raise ConfigError("deepseek MLA needs kv_lora_rank >= 1, an even qk_rope_head_dim >= 2 and v_head_dim >= 1; fix the MLA keys")


def _check_post_training(c: MaxTextConfig) -> None:
  """DPO and GRPO keys (docs/post_training.md); reward functions are imported by the preflight checks."""
  if c.use_dpo and c.use_grpo:
    raise ConfigError("use_dpo and use_grpo are both true; a run optimises one objective, set only one")
  method = "use_dpo" if c.use_dpo else "use_grpo" if c.use_grpo else ""
  if not method:
    return
  if c.use_sft:
    raise ConfigError(f"use_sft and {method} are both true; {method} builds its own rows from the data, set use_sft=false")
  off = {k: v for k, v in {"mtp_num_layers": c.mtp_num_layers, "z_loss_multiplier": c.z_loss_multiplier}.items() if v}
  if off:
    raise ConfigError(f"{', '.join(off)} add next-token losses that {method} does not use; set them to 0 (override_model_config=true for a model file's)")
  if c.dataset_type == "synthetic":
    raise ConfigError(f"{method} reads {'preference pairs' if c.use_dpo else 'prompts'} from data records; use dataset_type grain, tfds, hf or embedded")
  if c.use_dpo:
    if len(c.train_data_columns) not in (2, 3):
      raise ConfigError(
        f"use_dpo reads train_data_columns [chosen, rejected] or [prompt, chosen, rejected], got {c.train_data_columns}; name the columns of your pairs"
      )
    if not c.use_truncation:
      raise ConfigError("use_dpo keeps both responses of a pair in one row, truncating them to fit; set use_truncation=true")
    return
  if len(c.train_data_columns) != 1:
    raise ConfigError(f"use_grpo reads one prompt column, train_data_columns [prompt], got {c.train_data_columns}; name the prompt column")
  if c.num_generations < 2:
    raise ConfigError(f"num_generations={c.num_generations}: GRPO compares completions within a group of one prompt; set num_generations >= 2")
  if c.decode_sampling_strategy == "greedy":
    raise ConfigError(
      "use_grpo samples num_generations different completions per prompt, but decode_sampling_strategy=greedy makes them identical; "
      "set decode_sampling_strategy=weighted (or topk, nucleus)"
    )
  if not c.grpo_reward_functions:
    raise ConfigError("use_grpo needs rewards: set grpo_reward_functions=[module:function, ...] (see docs/post_training.md)")
  if c.grpo_reward_weights and len(c.grpo_reward_weights) != len(c.grpo_reward_functions):
    raise ConfigError(
      f"grpo_reward_weights has {len(c.grpo_reward_weights)} weights for {len(c.grpo_reward_functions)} grpo_reward_functions; give one weight per function or none"
    )
  if c.eval_interval > 0:
    raise ConfigError("use_grpo has no eval split loss (its rows are sampled); set eval_interval=-1")
  if c.lora.enable_lora and c.lora.max_lora_adapters > 1 and not c.lora.adapter_column:
    raise ConfigError(
      "use_grpo with lora.max_lora_adapters > 1 samples each prompt with its own adapter; set lora.adapter_column to the prompt column naming it"
    )
  if c.max_prefill_predict_length >= c.max_target_length:
    raise ConfigError(
      f"use_grpo: prompts of up to max_prefill_predict_length={c.max_prefill_predict_length} tokens leave no room for completions within "
      f"max_target_length={c.max_target_length}; lower the first or raise the second"
    )


def _check_family_fields(c: MaxTextConfig) -> None:
  """Attention and rope keys that need a family (or each other) to mean something."""
  from maxtext.models import registry  # the config loads before any model code otherwise

  family = registry.get(c.decoder_block)
  if c.attention_sink and not family.attention_sinks:
    with_sinks = sorted(f.name for f in registry.FAMILIES.values() if f.attention_sinks)
    raise ConfigError(
      f"attention_sink=true, but decoder_block={c.decoder_block} has no sink parameters (its checkpoints have none); sinks are for {', '.join(with_sinks)}: "
      "drop attention_sink"
    )
  if c.sliding_window_size and not any(family.layer_windows(_layer_shape(c))):
    raise ConfigError(
      f"sliding_window_size={c.sliding_window_size}, but decoder_block={c.decoder_block}'s layer pattern has no sliding-window layer; set it to 0"
    )
  if (c.attention_bias or c.attention_sink) and {"mla", "mla_sparse"} & _mixers(c):
    raise ConfigError(f"attention_bias and attention_sink apply to grouped-query attention; decoder_block={c.decoder_block} uses MLA, drop them")
  if c.mlp_activations_limit > 0 and not (family.clamped_glu or family.deepseek4_keys):
    with_glu = sorted(f.name for f in registry.FAMILIES.values() if f.clamped_glu or f.deepseek4_keys)
    raise ConfigError(f"mlp_activations_limit clamps the experts' SwiGLU of {', '.join(with_glu)}, not decoder_block={c.decoder_block}; set it to -1")
  if family.clamped_glu and not c.mlp_activations_limit > 0:
    raise ConfigError(f"decoder_block={c.decoder_block} clamps its experts' SwiGLU; set mlp_activations_limit > 0 (gpt-oss: 7.0)")
  if family.clamped_glu and len(c.mlp_activations) != 2:
    raise ConfigError(f"decoder_block={c.decoder_block} has gated experts; set mlp_activations to two entries, e.g. [sigmoid, linear]")
  if c.local_rope_max_timescale != -1 and c.local_rope_max_timescale <= 0:
    raise ConfigError(f"invalid value for 'local_rope_max_timescale': {c.local_rope_max_timescale}; use -1 (= rope_max_timescale) or a positive base")
  if c.rope_linear_scaling_factor != 1.0 and c.rope_type != "default":
    raise ConfigError(f"rope_linear_scaling_factor scales the default rope; rope_type={c.rope_type} has its own scaling: set one of the two")
  _check_gemma4_fields(c, family)
  _check_deepseek4_fields(c, family)


GEMMA4_KEYS = (
  "global_head_dim",
  "global_num_kv_heads",
  "share_kv_projections",
  "v_norm_with_scale",
  "global_rope_max_timescale",
  "global_rope_proportion",
  "local_rope_proportion",
  "hidden_size_per_layer_input",
  "vocab_size_per_layer_input",
  "num_kv_shared_layers",
  "use_double_wide_mlp",
)


def _check_gemma4_fields(c: MaxTextConfig, family) -> None:
  """Gemma 4's keys: only for a family that builds them, and KV sharing that its layer pattern can serve."""
  if not family.gemma4_keys:
    changed = [k for k in GEMMA4_KEYS if getattr(c, k) != type(c).model_fields[k].default]
    if changed:
      raise ConfigError(f"{', '.join(changed)} apply to gemma4 layers, not decoder_block={c.decoder_block}; drop them (or set decoder_block=gemma4)")
    return
  layers = _layer_shape(c).num_decoder_layers
  if c.num_kv_shared_layers >= layers:
    raise ConfigError(f"num_kv_shared_layers={c.num_kv_shared_layers} leaves none of the {layers} layers to compute keys and values; make it < {layers}")
  kinds = family.kinds(_layer_shape(c))
  sources = {k.window for k in kinds if not k.kv_shared}
  orphan = next((i for i, k in enumerate(kinds) if k.kv_shared and k.window not in sources), None)
  if orphan is not None:
    kind = "sliding-window" if kinds[orphan].window else "global"
    raise ConfigError(
      f"num_kv_shared_layers={c.num_kv_shared_layers}: layer {orphan} ({kind}) shares the keys and values of an earlier {kind} layer, but every {kind} "
      "layer is shared; lower num_kv_shared_layers"
    )
  if c.hidden_size_per_layer_input and 0 < c.vocab_size_per_layer_input < c.vocab_size:  # ids past the table would look up NaN rows
    raise ConfigError(
      f"vocab_size_per_layer_input={c.vocab_size_per_layer_input} leaves token ids {c.vocab_size_per_layer_input}..{c.vocab_size - 1} of "
      f"vocab_size={c.vocab_size} without a per-layer input row; set vocab_size_per_layer_input=0 (vocab_size) or >= {c.vocab_size}"
    )
  if c.hidden_size_per_layer_input and c.mhc_expansion_rate > 1:
    raise ConfigError("hidden_size_per_layer_input adds per-layer inputs to one residual stream; set mhc_expansion_rate=1 (or hidden_size_per_layer_input=0)")
  if c.mtp_num_layers:
    raise ConfigError(f"mtp_num_layers={c.mtp_num_layers}: multi-token prediction is not built for gemma4's layers; set mtp_num_layers=0")
  if c.num_experts > 1 and c.shared_experts != 1:
    raise ConfigError(
      f"shared_experts={c.shared_experts}: gemma4's experts run beside each layer's dense MLP of mlp_dim, its one shared expert; set shared_experts=1"
    )


DEEPSEEK4_KEYS = ("compress_ratios", "csa_compress_ratio", "o_groups", "o_lora_rank", "first_num_hash_layers", "compressed_rope_max_timescale", "hc_eps")


def _check_deepseek4_fields(c: MaxTextConfig, family) -> None:
  """DeepSeek V4's keys: only for its family, and a layer pattern, output projection and mHC its layers can build."""
  if not family.deepseek4_keys:
    changed = [k for k in DEEPSEEK4_KEYS if getattr(c, k) != type(c).model_fields[k].get_default(call_default_factory=True)]
    if changed:
      raise ConfigError(f"{', '.join(changed)} apply to deepseek4 layers, not decoder_block={c.decoder_block}; drop them (or set decoder_block=deepseek4)")
    return
  layers = _layer_shape(c).num_decoder_layers
  if len(c.compress_ratios) != layers:
    raise ConfigError(
      f"compress_ratios has {len(c.compress_ratios)} entries for {layers} decoder layers; give one compress rate per layer (0: sliding window only)"
    )
  if any(r < 0 for r in c.compress_ratios):
    raise ConfigError(f"compress_ratios {c.compress_ratios} has a negative rate; use 0 (sliding window only) or a positive rate")
  if c.first_num_hash_layers > layers:
    raise ConfigError(f"first_num_hash_layers={c.first_num_hash_layers} exceeds the {layers} decoder layers; lower it")
  if not c.sliding_window_size > 0:
    raise ConfigError("decoder_block=deepseek4 attends within a sliding window in every layer; set sliding_window_size > 0 (V4: 128)")
  if not (c.o_groups > 0 and c.o_lora_rank > 0 and c.q_lora_rank > 0):
    raise ConfigError("decoder_block=deepseek4 projects queries through q_lora_rank and outputs through o_groups x o_lora_rank; set all three > 0")
  if c.mhc_expansion_rate < 2:
    raise ConfigError(f"decoder_block=deepseek4 keeps mHC's residual streams in every layer; set mhc_expansion_rate >= 2 (V4: 4), not {c.mhc_expansion_rate}")
  if c.num_experts <= 1 or c.shared_experts < 1:
    raise ConfigError("decoder_block=deepseek4's layers are experts beside shared experts; set num_experts > 1 and shared_experts >= 1")
  if not c.mlp_activations_limit > 0 or len(c.mlp_activations) != 2:
    raise ConfigError("decoder_block=deepseek4 clamps its gated experts' SwiGLU; set mlp_activations_limit > 0 (V4: 10) and two mlp_activations")
  if c.mtp_num_layers:
    raise ConfigError(f"mtp_num_layers={c.mtp_num_layers}: multi-token prediction is not built for deepseek4's layers; set mtp_num_layers=0")
  if c.quantize_kvcache:
    raise ConfigError("quantize_kvcache quantizes keys and values per head; deepseek4's compressed cache is not quantized here: set quantize_kvcache=false")


def _check_indexer(c: MaxTextConfig) -> None:
  """DeepSeek Sparse Attention's keys: use_indexer exactly with the sparse MLA layers of decoder_block=deepseek_v32."""
  sparse = "mla_sparse" in _mixers(c)
  if c.use_indexer and not sparse and "compressed" not in _mixers(c):  # deepseek4's indexer: the indexer_* keys, in its CSA layers
    raise ConfigError(
      f"use_indexer=true, but decoder_block={c.decoder_block} has no sparse attention layers; "
      "MaxText's deepseek with use_indexer is decoder_block=deepseek_v32 here: set it, or use_indexer=false"
    )
  if sparse and not c.use_indexer:
    raise ConfigError(f"decoder_block={c.decoder_block} attends through the lightning indexer; set use_indexer=true (or decoder_block=deepseek for dense MLA)")
  if sparse and not c.q_lora_rank:
    raise ConfigError("DeepSeek Sparse Attention's indexer projects MLA's query latent; set q_lora_rank > 0")
  if sparse and c.indexer_head_dim < c.qk_rope_head_dim:
    raise ConfigError(f"indexer_head_dim={c.indexer_head_dim} is smaller than its rotary part qk_rope_head_dim={c.qk_rope_head_dim}; raise indexer_head_dim")


def _check_llama4_fields(c: MaxTextConfig) -> None:
  """Llama 4's pattern keys mean something only to a family with its pattern (and rope_use_scale only to llama3.1 rope)."""
  import math

  from maxtext.models import family as family_lib
  from maxtext.models import registry  # the config loads before any model code otherwise

  if not c.rope_use_scale and c.rope_type != "llama3.1":
    raise ConfigError(f"rope_use_scale=false turns off llama3.1 rope's scaling, but rope_type={c.rope_type}; drop rope_use_scale")
  if registry.get(c.decoder_block).layer_pattern is not family_lib.llama4_pattern:
    for key, default in (("interleave_moe_layer_step", 1), ("nope_layer_interval", -1), ("chunk_attn_window_size", 0), ("temperature_tuning", False)):
      if getattr(c, key) != default:
        raise ConfigError(f"{key}={getattr(c, key)} shapes llama4's layer pattern, not decoder_block={c.decoder_block}'s; set it to {default}")
    return
  if c.nope_layer_interval == 0 or c.nope_layer_interval < -1:
    raise ConfigError(f"invalid value for 'nope_layer_interval': {c.nope_layer_interval}; use -1 (no NoPE layers) or a positive interval")
  if not c.chunk_attn_window_size:
    raise ConfigError("llama4's rope layers attend within chunks; set chunk_attn_window_size > 0 (8192 in the published models)")
  period = math.lcm(c.interleave_moe_layer_step, max(c.nope_layer_interval, 1))
  if c.inhomogeneous_layer_cycle_interval not in (1, period):
    raise ConfigError(
      f"inhomogeneous_layer_cycle_interval={c.inhomogeneous_layer_cycle_interval}, but llama4's pattern of interleave_moe_layer_step="
      f"{c.interleave_moe_layer_step} and nope_layer_interval={c.nope_layer_interval} repeats every {period} layers; set it to {period}"
    )


def _check_vision_training(c: MaxTextConfig) -> None:
  """The llama4 *_for_vit keys mean something only to llama4; vision_learning_rate_scale needs a vision tower that trains
  (freeze_vision_encoder_params is MaxText's key, true in its base.yml, and does nothing without use_multimodal)."""
  from maxtext.config.model_sections import Llama4Vision

  if c.decoder_block != "llama4":
    for key, field in Llama4Vision.model_fields.items():
      if getattr(c, key) != field.default:
        raise ConfigError(f"{key}={getattr(c, key)} shapes llama4's vision tower, not decoder_block={c.decoder_block}'s; set it to {field.default}")
  if c.vision_learning_rate_scale == 1.0:
    return
  scale = f"vision_learning_rate_scale={c.vision_learning_rate_scale}"
  if not c.use_multimodal:
    raise ConfigError(f"{scale} scales the vision tower's learning rate, but use_multimodal=false builds none; drop it or set use_multimodal=true")
  if c.freeze_vision_encoder_params:
    raise ConfigError(f"{scale} scales the vision tower's learning rate, but freeze_vision_encoder_params=true freezes it; drop one of the two")
  if c.lora.enable_lora:
    raise ConfigError(f"{scale} scales the vision tower's learning rate, but with lora.enable_lora only the adapters train; drop it")


def compute(c: MaxTextConfig, num_devices: int | None = None, num_slices: int | None = None) -> dict[str, Any]:
  """All derived values of a validated user config, as a dict of updates."""
  mult = scale_dims(c.global_parameter_scale)
  heads = c.base_num_query_heads * mult["heads"]
  kv_heads = c.base_num_kv_heads * mult["heads"]
  _check_cross_fields(c, heads, kv_heads)
  _check_local_tier(c)

  devices, slices = _device_counts(c, num_devices, num_slices)
  if devices % slices:
    raise ConfigError(f"{devices} devices do not split evenly into {slices} slices")
  axes, batch_axes = diloco_axes(c)
  ici = fill_parallelism([getattr(c, parallelism_key("ici", a)) for a in axes], devices // slices, "ici", axes)
  dcn = fill_parallelism([getattr(c, parallelism_key("dcn", a)) for a in axes], slices, "dcn", axes)

  _check_quantization_tiles(c, slices if c.quantization_local_shard_count == -1 else c.quantization_local_shard_count)
  micro = devices * c.per_device_batch_size
  if micro < 1 or micro != int(micro):
    raise ConfigError(
      f"per_device_batch_size {c.per_device_batch_size} x {devices} devices = {micro} sequences is not a positive whole number; change per_device_batch_size"
    )
  micro = int(micro)
  eval_rows = devices * (c.eval_per_device_batch_size or c.per_device_batch_size)
  if eval_rows != int(eval_rows):
    raise ConfigError(
      f"eval_per_device_batch_size {c.eval_per_device_batch_size} x {devices} devices = {eval_rows} sequences is not a whole number; change eval_per_device_batch_size"
    )
  if c.use_grpo and c.eval_per_device_batch_size:
    raise ConfigError("eval_per_device_batch_size does not apply to GRPO, whose evaluation rolls out batches of the training size; leave it 0")
  if c.use_grpo and (micro * c.gradient_accumulation_steps) % c.num_generations:
    raise ConfigError(
      f"use_grpo: a batch of {micro * c.gradient_accumulation_steps} rows does not hold whole groups of num_generations={c.num_generations} completions; "
      "make the global batch a multiple of num_generations"
    )
  layers = c.base_num_decoder_layers * mult["layers"]
  batch_shards = math.prod(axis_size(ici, dcn, axes, a) for a in set(batch_axes))
  check_diloco(c, axis_size(ici, dcn, axes, "diloco"), axis_size(ici, dcn, axes, "stage"), micro)
  pipeline = pipeline_values(c, axis_size(ici, dcn, axes, "stage"), layers, micro, batch_shards)
  if c.eval_per_device_batch_size and eval_rows % batch_shards:
    raise ConfigError(
      f"eval_per_device_batch_size {c.eval_per_device_batch_size} x {devices} devices = {int(eval_rows)} sequences do not split over the {batch_shards} "
      "batch shards (data_sharding axes); change eval_per_device_batch_size"
    )
  check_context(c, axis_size(ici, dcn, axes, "context"), axis_size(ici, dcn, axes, "sequence"))

  run_name = c.run_name or f"{c.model_name}_{datetime.datetime.now():%Y-%m-%d-%H-%M}"
  check_run_name(run_name)
  paths = resolve_paths(c)
  run_dir = absolute_path(os.path.join(paths.get("base_output_directory", c.base_output_directory), run_name))  # '' -> the working directory

  return {
    **paths,
    "run_name": run_name,
    "emb_dim": c.base_emb_dim * mult["emb"],
    "num_query_heads": heads,
    "num_kv_heads": kv_heads,
    "mlp_dim": c.base_mlp_dim * mult["heads"],
    "moe_mlp_dim": (c.base_moe_mlp_dim if c.base_moe_mlp_dim != -1 else c.base_mlp_dim) * mult["heads"],
    "num_decoder_layers": layers,
    **pipeline,
    "num_devices": devices,
    "num_slices": slices,
    "mesh_axes": axes,
    "data_sharding": batch_axes,
    "ici_parallelism": ici,
    "dcn_parallelism": dcn,
    "micro_batch_size_to_train_on": micro,
    "global_batch_size_to_train_on": micro * c.gradient_accumulation_steps,
    "global_batch_size_to_eval_on": int(eval_rows),
    "learning_rate_schedule_steps": c.steps if c.learning_rate_schedule_steps == -1 else c.learning_rate_schedule_steps,
    "checkpoint_dir": os.path.join(run_dir, "checkpoints", ""),
    "tensorboard_dir": os.path.join(run_dir, "tensorboard", ""),
  }
