"""Derived config values (model dimensions, mesh degrees, batch sizes, run paths), computed in one place after the checks of
maxtext.config.cross_checks (the mesh degrees and the pipeline and context checks in maxtext.config.parallelism)."""

from __future__ import annotations

import datetime
import math
import os
from typing import TYPE_CHECKING, Any

from maxtext.config.cross_checks import check_cross_fields, check_local_tier
from maxtext.config.model_shape import scale_dims
from maxtext.config.parallelism import axis_size, check_context, check_diloco, diloco_axes, fill_parallelism, parallelism_key, pipeline_values
from maxtext.config.paths import absolute_path, check_run_name, resolve_paths
from maxtext.config.quantization_checks import check_quantization_tiles
from maxtext.errors import ConfigError

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig


def _device_counts(config: MaxTextConfig, num_devices: int | None, num_slices: int | None) -> tuple[int, int]:
  """The counts given, else the AOT topology's; loading a config never asks JAX (the loader passes its counts)."""
  if num_devices is not None:
    return num_devices, num_slices or 1
  if config.compile_topology:
    from maxtext import topology

    topo = topology.parse(config.compile_topology)
    return topo.chips * config.compile_topology_num_slices, config.compile_topology_num_slices
  raise ValueError("derived.compute needs num_devices unless compile_topology is set")


def compute(c: MaxTextConfig, num_devices: int | None = None, num_slices: int | None = None) -> dict[str, Any]:
  """All derived values of a validated user config, as a dict of updates."""
  mult = scale_dims(c.global_parameter_scale)
  heads = c.base_num_query_heads * mult["heads"]
  kv_heads = c.base_num_kv_heads * mult["heads"]
  check_cross_fields(c, heads, kv_heads)
  check_local_tier(c)

  devices, slices = _device_counts(c, num_devices, num_slices)
  if devices % slices:
    raise ConfigError(f"{devices} devices do not split evenly into {slices} slices")
  axes, batch_axes = diloco_axes(c)
  ici = fill_parallelism([getattr(c, parallelism_key("ici", a)) for a in axes], devices // slices, "ici", axes)
  dcn = fill_parallelism([getattr(c, parallelism_key("dcn", a)) for a in axes], slices, "dcn", axes)

  check_quantization_tiles(c, slices if c.quantization_local_shard_count == -1 else c.quantization_local_shard_count)
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
