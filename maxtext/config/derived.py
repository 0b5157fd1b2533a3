"""Derived config values and cross-field checks, computed in one place."""

from __future__ import annotations

import datetime
import math
import os
from typing import TYPE_CHECKING, Any

from maxtext.errors import ConfigError

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig

PARALLEL_AXES = ("data", "fsdp", "sequence", "tensor", "expert")


def scale_dims(global_parameter_scale: int) -> dict[str, int]:
  """Multipliers for layers, heads/mlp and emb from global_parameter_scale = 2^k."""
  scale = global_parameter_scale
  if scale < 1 or scale & (scale - 1):
    raise ConfigError(f"invalid value for 'global_parameter_scale': {scale}; it must be a power of two (1, 2, 4, 8, ...)")
  q, r = divmod(int(math.log2(scale)), 3)
  return {"layers": 2**q, "heads": 2 ** (q + (r > 0)), "emb": 2 ** (q + (r > 1))}


def fill_parallelism(values: list[int], total: int, kind: str, mesh_axes: list[str]) -> list[int]:
  """Fill the one -1 so the product equals total; error if impossible."""
  names = [f"{kind}_{a}_parallelism" for a in mesh_axes]
  if any(v == 0 or v < -1 for v in values):
    bad = next(n for n, v in zip(names, values) if v == 0 or v < -1)
    raise ConfigError(f"invalid value for '{bad}': {values[names.index(bad)]}; use a positive integer or -1 to fill")
  fills = [n for n, v in zip(names, values) if v == -1]
  if len(fills) > 1:
    raise ConfigError(f"only one {kind} parallelism may be -1, got {', '.join(fills)}; set all but one explicitly")
  known = math.prod(v for v in values if v != -1)
  if fills:
    if total % known:
      raise ConfigError(f"{kind} parallelism {dict(zip(names, values))} cannot fill {total} devices: {known} does not divide {total}")
    return [total // known if v == -1 else v for v in values]
  if known != total:
    unit = "slices" if kind == "dcn" else "devices per slice"
    raise ConfigError(f"{kind} parallelism product {known} ({' x '.join(map(str, values))}) != {total} {unit}; change one to -1 to fill")
  return list(values)


def _device_counts(config: MaxTextConfig, num_devices: int | None, num_slices: int | None) -> tuple[int, int]:
  if num_devices is not None:
    return num_devices, num_slices or 1
  if config.compile_topology:
    from maxtext import topology

    topo = topology.parse(config.compile_topology)
    return topo.chips * config.compile_topology_num_slices, config.compile_topology_num_slices
  import jax

  devices = jax.devices()
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  return len(devices), slices


def _check_cross_fields(c: MaxTextConfig, heads: int, kv_heads: int) -> None:
  if c.lora.max_lora_adapters > 1 or c.lora.lora_adapters:
    from maxtext.layers.lora import adapter_specs  # validates names, ranks and their count

    adapter_specs(c)
  if heads % kv_heads:
    raise ConfigError(f"num_query_heads {heads} is not a multiple of num_kv_heads {kv_heads}; change base_num_query_heads or base_num_kv_heads")
  if c.num_experts_per_tok > c.num_experts:
    raise ConfigError(f"num_experts_per_tok {c.num_experts_per_tok} > num_experts {c.num_experts}; lower num_experts_per_tok")
  if c.load_parameters_path and c.load_full_state_path:
    raise ConfigError("load_parameters_path and load_full_state_path are both set; set only one")
  if c.learning_rate_schedule_steps != -1 and c.learning_rate_schedule_steps < 1:
    raise ConfigError(f"invalid value for 'learning_rate_schedule_steps': {c.learning_rate_schedule_steps}; use -1 (= steps) or a positive integer")
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


def compute(c: MaxTextConfig, num_devices: int | None = None, num_slices: int | None = None) -> dict[str, Any]:
  """All derived values of a validated user config, as a dict of updates."""
  mult = scale_dims(c.global_parameter_scale)
  heads = c.base_num_query_heads * mult["heads"]
  kv_heads = c.base_num_kv_heads * mult["heads"]
  _check_cross_fields(c, heads, kv_heads)

  devices, slices = _device_counts(c, num_devices, num_slices)
  if devices % slices:
    raise ConfigError(f"{devices} devices do not split evenly into {slices} slices")
  axes = list(c.mesh_axes)
  ici = fill_parallelism([getattr(c, f"ici_{a}_parallelism") for a in axes], devices // slices, "ici", axes)
  dcn = fill_parallelism([getattr(c, f"dcn_{a}_parallelism") for a in axes], slices, "dcn", axes)

  micro = devices * c.per_device_batch_size
  if micro < 1 or micro != int(micro):
    raise ConfigError(
      f"per_device_batch_size {c.per_device_batch_size} x {devices} devices = {micro} sequences is not a positive whole number; change per_device_batch_size"
    )
  micro = int(micro)

  run_name = c.run_name or f"{c.model_name}_{datetime.datetime.now():%Y-%m-%d-%H-%M}"
  if os.sep in run_name or run_name in (".", ".."):
    raise ConfigError(f"invalid value for 'run_name': {run_name!r}; use a plain name without '/'")
  run_dir = os.path.join(c.base_output_directory, run_name)

  return {
    "run_name": run_name,
    "emb_dim": c.base_emb_dim * mult["emb"],
    "num_query_heads": heads,
    "num_kv_heads": kv_heads,
    "mlp_dim": c.base_mlp_dim * mult["heads"],
    "num_decoder_layers": c.base_num_decoder_layers * mult["layers"],
    "num_devices": devices,
    "num_slices": slices,
    "ici_parallelism": ici,
    "dcn_parallelism": dcn,
    "micro_batch_size_to_train_on": micro,
    "global_batch_size_to_train_on": micro * c.gradient_accumulation_steps,
    "learning_rate_schedule_steps": c.steps if c.learning_rate_schedule_steps == -1 else c.learning_rate_schedule_steps,
    "checkpoint_dir": os.path.join(run_dir, "checkpoints", ""),
    "metrics_dir": os.path.join(run_dir, "metrics", ""),
    "tensorboard_dir": os.path.join(run_dir, "tensorboard", ""),
  }
