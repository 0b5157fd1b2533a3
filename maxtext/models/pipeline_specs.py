"""The pipeline plan and schedule around the main layer stack, read from the config (None without pipeline parallelism)."""

from __future__ import annotations

from maxtext.config import MaxTextConfig
from maxtext.config.parallelism import axis_size
from maxtext.errors import ConfigError
from maxtext.models import layer_pattern
from maxtext.models.common_specs import family_of, rules
from maxtext.models.pipeline import STAGE_AXIS, Plan, Schedule


def pipeline_plan(config: MaxTextConfig) -> Plan | None:
  """The config's pipeline plan, or None without pipeline parallelism. A main stack that repeats a block of p > 1
  different layers (qwen3_next: 3 Gated DeltaNet layers + 1 attention layer) is pipelined block by block: each stage
  runs num_layers_per_pipeline_stage / p whole blocks per visit, and the layers after the last whole block run after
  the pipeline on every stage."""
  c = config
  stages = axis_size(c.ici_parallelism, c.dcn_parallelism, c.mesh_axes, STAGE_AXIS)
  if stages == 1:
    return None
  main = layer_pattern.stacks(family_of(c).kinds(c))[-1]
  p, lps, piped = main.period, c.num_layers_per_pipeline_stage, c.pipeline_parallel_layers
  if p > 1:
    if lps % p:
      raise ConfigError(
        f"decoder_block={c.decoder_block} repeats a block of {p} different layers, which each stage runs whole: num_layers_per_pipeline_stage "
        f"{lps} is not a multiple of {p}; set it to a multiple of {p}"
      )
    if piped != main.num_groups * p:
      raise ConfigError(
        f"decoder_block={c.decoder_block} pipelines its whole blocks of {p} layers: pipeline_parallel_layers {piped} is not their "
        f"{main.num_groups} x {p} = {main.num_groups * p} layers; set pipeline_parallel_layers={main.num_groups * p}, or -1 when that is all layers"
      )
    if any(k.kv_shared for k in main.kinds) or c.hidden_size_per_layer_input:
      raise ConfigError(f"decoder_block={c.decoder_block}'s KV sharing or per-layer inputs do not run under the pipeline; set ici/dcn_pipeline_parallelism=1")
  return Plan(
    stages,
    c.num_pipeline_repeats,
    lps // p,
    c.num_pipeline_microbatches,
    2 if c.pipeline_delay_activation_forwarding else 1,
    c.pipeline_fsdp_ag_once,
    0 if p > 1 else c.num_decoder_layers - c.first_num_dense_layers - piped,
    p,
    len(main.remainder),
  )


def pipeline(config: MaxTextConfig) -> Schedule | None:
  """The pipeline schedule around the main layer stack, or None without pipeline parallelism."""
  plan = pipeline_plan(config)
  if plan is None:
    return None
  fsdp_axes = frozenset(dict(rules(config)).get("embed", ()))  # the mesh axes the layers' 'embed' dimension is sharded over
  return Schedule(plan, rules(config), fsdp_axes, config.remat_policy, config.num_experts_per_tok)
