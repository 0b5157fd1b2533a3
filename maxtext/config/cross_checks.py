"""Cross-field checks of a validated user config: the general ones, the local checkpoint tier and post-training (DPO, GRPO) here;
the quantization and model family checks in their own modules."""

from __future__ import annotations

import importlib.util
import re
from typing import TYPE_CHECKING

from maxtext.config.adapters import adapter_specs
from maxtext.config.model_checks import check_family_fields, check_indexer, check_llama4_fields, check_moe_fields, check_vision_training
from maxtext.config.parallelism import PARALLEL_AXES
from maxtext.config.quantization_checks import check_quantization
from maxtext.errors import ConfigError

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig


def check_cross_fields(c: MaxTextConfig, heads: int, kv_heads: int) -> None:
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
  check_moe_fields(c)
  check_quantization(c)
  _check_post_training(c)
  check_family_fields(c)
  check_indexer(c)
  check_llama4_fields(c)
  check_vision_training(c)
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


def check_local_tier(c: MaxTextConfig) -> None:
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
