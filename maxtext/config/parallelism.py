"""The device mesh's degrees (ici_*/dcn_* parallelism, one -1 filled) and the checks and derived values of the
`stage` (pipeline) and `context` axes; maxtext.config.derived calls them while resolving a config."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from maxtext.config.model_shape import mixers
from maxtext.errors import ConfigError

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig

PARALLEL_AXES = ("diloco", "data", "stage", "fsdp", "sequence", "context", "tensor", "expert")
DILOCO_AXIS = "diloco"  # the mesh axis of DiLoCo replica groups (enable_diloco); outermost, added to mesh_axes when enabled


def parallelism_key(kind: str, axis: str) -> str:
  """The config key of one mesh axis: ici_<axis>_parallelism / dcn_<axis>_parallelism ('stage' is MaxText's *_pipeline_parallelism)."""
  return f"{kind}_{'pipeline' if axis == 'stage' else axis}_parallelism"


def fill_parallelism(values: list[int], total: int, kind: str, mesh_axes: list[str]) -> list[int]:
  """Fill the one -1 so the product equals total; error if impossible."""
  names = [parallelism_key(kind, a) for a in mesh_axes]
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


def axis_size(ici: list[int], dcn: list[int], mesh_axes: list[str], axis: str) -> int:
  """Devices along one mesh axis (ICI x DCN); 1 for an axis the mesh lacks."""
  if axis not in mesh_axes:
    return 1
  i = list(mesh_axes).index(axis)
  return ici[i] * dcn[i]


PIPELINE_ONLY_KEYS = (
  "num_pipeline_microbatches",
  "num_pipeline_repeats",
  "num_layers_per_pipeline_stage",
  "pipeline_parallel_layers",
  "pipeline_fsdp_ag_once",
  "pipeline_delay_activation_forwarding",
)
_PIPELINE_KEY_DEFAULTS = {"num_pipeline_microbatches": -1, "num_pipeline_repeats": -1, "num_layers_per_pipeline_stage": 1, "pipeline_parallel_layers": -1}
STAGE_KEYS = "ici_pipeline_parallelism x dcn_pipeline_parallelism"
CONTEXT_KEYS = "ici_context_parallelism x dcn_context_parallelism"


def _pipelined_layers(c: MaxTextConfig, main: int, stages: int) -> tuple[int, str]:
  """(the number of main-stack layers the pipeline runs, how messages name them), after the checks on
  pipeline_parallel_layers; main: the layers after first_num_dense_layers."""
  lps = c.num_layers_per_pipeline_stage
  after_dense = f" after first_num_dense_layers {c.first_num_dense_layers}" if c.first_num_dense_layers else ""
  if c.pipeline_parallel_layers == -1:
    piped, what = main, f"{main} decoder layers{after_dense}"
  elif 0 < c.pipeline_parallel_layers <= main:
    piped, what = c.pipeline_parallel_layers, f"pipeline_parallel_layers {c.pipeline_parallel_layers}"
  else:
    raise ConfigError(f"pipeline_parallel_layers {c.pipeline_parallel_layers} is not -1 (all) or 1..{main}, the decoder layers{after_dense}; change it")
  if piped % (stages * lps):
    fitting = main // (stages * lps) * (stages * lps)
    hint = f", or pipeline only pipeline_parallel_layers={fitting} of them" if c.pipeline_parallel_layers == -1 and fitting else ""
    raise ConfigError(
      f"{what} do not split into {stages} stages ({STAGE_KEYS}) x num_layers_per_pipeline_stage {lps} x whole repeats; "
      f"change num_layers_per_pipeline_stage or the stage count{hint}"
    )
  return piped, what


def pipeline_values(c: MaxTextConfig, stages: int, layers: int, batch: int, batch_shards: int) -> dict[str, int]:
  """num_pipeline_repeats, num_pipeline_microbatches and pipeline_parallel_layers, resolved, after the checks a pipeline needs."""
  if stages == 1:
    set_keys = [k for k in PIPELINE_ONLY_KEYS if getattr(c, k) != _PIPELINE_KEY_DEFAULTS.get(k, False)]
    if set_keys:
      raise ConfigError(
        f"{', '.join(set_keys)} configure pipeline parallelism, but {STAGE_KEYS} is 1; set ici_pipeline_parallelism or dcn_pipeline_parallelism > 1, or drop them"
      )
    return {"num_pipeline_repeats": 1, "num_pipeline_microbatches": 1}
  if not c.scan_layers:
    raise ConfigError(f"pipeline parallelism ({STAGE_KEYS} = {stages}) runs scanned layers; set scan_layers=true")
  lps = c.num_layers_per_pipeline_stage
  piped, what = _pipelined_layers(c, layers - c.first_num_dense_layers, stages)
  repeats = piped // (stages * lps)
  if c.num_pipeline_repeats not in (-1, repeats):
    raise ConfigError(
      f"num_pipeline_repeats {c.num_pipeline_repeats} disagrees with {what} / ({stages} stages x num_layers_per_pipeline_stage {lps}) = {repeats}; leave it at -1"
    )
  delay = 2 if c.pipeline_delay_activation_forwarding else 1
  micro = c.num_pipeline_microbatches if c.num_pipeline_microbatches != -1 else stages * delay
  if micro < 1 or micro % stages:
    raise ConfigError(
      f"num_pipeline_microbatches {micro} is not a positive multiple of the {stages} pipeline stages ({STAGE_KEYS}); change num_pipeline_microbatches"
    )
  if batch % micro:
    raise ConfigError(
      f"num_pipeline_microbatches {micro} does not divide the global batch of {batch} sequences (per_device_batch_size x devices); change one of them"
    )
  if (batch // micro) % batch_shards:
    raise ConfigError(
      f"each of the num_pipeline_microbatches {micro} microbatches holds {batch // micro} sequences, not divisible by the {batch_shards} batch shards "
      "(data_sharding axes); raise per_device_batch_size or lower num_pipeline_microbatches"
    )
  if repeats > 1 and micro < delay * stages:
    raise ConfigError(
      f"the circular schedule (num_pipeline_repeats {repeats}) with pipeline_delay_activation_forwarding needs num_pipeline_microbatches >= 2 x {stages} stages, got {micro}"
    )
  return {"num_pipeline_repeats": repeats, "num_pipeline_microbatches": micro, "pipeline_parallel_layers": piped}


def check_context(c: MaxTextConfig, context: int, sequence: int) -> None:
  if context == 1:
    return
  chunks = 2 * context if c.context_parallel_load_balance else context
  if c.max_target_length % chunks:
    how = (
      f"2 x {context} context shards ({CONTEXT_KEYS}; context_parallel_load_balance cuts 2 chunks per shard)"
      if c.context_parallel_load_balance
      else f"{context} context shards ({CONTEXT_KEYS})"
    )
    raise ConfigError(f"max_target_length {c.max_target_length} is not divisible by {how}; change max_target_length or the context parallelism")
  if sequence > 1:
    raise ConfigError(f"context parallelism ({CONTEXT_KEYS} = {context}) and sequence parallelism both split the sequence; use one of them")
  if c.context_parallel_strategy == "ring" and "mla_sparse" in mixers(c):
    raise ConfigError(
      f"context_parallel_strategy=ring passes whole keys around the shards, but decoder_block={c.decoder_block}'s sparse attention "
      "reads each query's top-k of the gathered latent keys; set context_parallel_strategy=all_gather"
    )


DILOCO_KEYS = "ici_diloco_parallelism x dcn_diloco_parallelism"


def diloco_axes(c: MaxTextConfig) -> tuple[list[str], list[str]]:
  """mesh_axes and data_sharding with the 'diloco' axis outermost when enable_diloco (as MaxText's default mesh has it);
  as configured otherwise, where a diloco degree other than 1 is an error."""
  axes, batch = list(c.mesh_axes), list(c.data_sharding)
  if not c.enable_diloco:
    if DILOCO_AXIS not in axes and (c.ici_diloco_parallelism, c.dcn_diloco_parallelism) != (1, 1):
      raise ConfigError(
        f"{DILOCO_KEYS} = {c.ici_diloco_parallelism} x {c.dcn_diloco_parallelism} splits replicas into DiLoCo groups, but enable_diloco is false; "
        "set enable_diloco=true or leave both at 1"
      )
    return axes, batch
  if DILOCO_AXIS not in axes:
    axes = [DILOCO_AXIS, *axes]
  if DILOCO_AXIS not in batch:
    batch = [DILOCO_AXIS, *batch]
  return axes, batch


def check_diloco(c: MaxTextConfig, groups: int, stages: int, batch: int) -> None:
  """The one-line errors of enable_diloco: at least 2 groups, no pipeline, a batch that splits into the groups,
  and none of the features whose state the groups would not keep apart."""
  if not c.enable_diloco:
    return
  if groups < 2:
    raise ConfigError(
      f"enable_diloco=true needs at least 2 DiLoCo groups, got {DILOCO_KEYS} = {groups}; set dcn_diloco_parallelism=2 (across slices) "
      "or ici_diloco_parallelism=2 (within a slice), or enable_diloco=false"
    )
  if stages > 1:
    raise ConfigError(f"enable_diloco with pipeline parallelism ({STAGE_KEYS} = {stages}) is not supported; use one of the two")
  if batch % groups:
    raise ConfigError(f"the global batch of {batch} sequences does not split into {groups} DiLoCo groups; change per_device_batch_size")
  unsupported = [
    key
    for key, on in (
      ("use_dpo", c.use_dpo),
      ("use_grpo", c.use_grpo),
      ("lora.enable_lora", c.lora.enable_lora),
      ("optimizer_memory_host_offload", c.optimizer_memory_host_offload),
      ("routed_bias_update_rate", c.routed_bias_update_rate > 0),
    )
    if on
  ]
  if unsupported:
    raise ConfigError(f"enable_diloco is not supported with {', '.join(unsupported)}; turn one of the two off")
