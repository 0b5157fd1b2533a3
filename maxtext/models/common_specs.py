"""The spec pieces every layer's spec shares, read from the config: sharding rules, norms, the rotary embedding, context
parallelism's layout, and the family of decoder_block."""

from __future__ import annotations

from maxtext.config import MaxTextConfig
from maxtext.config.parallelism import axis_size
from maxtext.layers import context_parallel
from maxtext.layers.norms import NormSpec
from maxtext.layers.rope import RopeSpec
from maxtext.layers.sharding import Rules
from maxtext.models.family import Family


def rules(config: MaxTextConfig) -> Rules:
  """logical_axis_rules as nested tuples (hashable: specs sit in graphdefs)."""
  return tuple((name, tuple(axes)) for name, axes in config.logical_axis_rules)


def norm(config: MaxTextConfig, family: Family | None = None) -> NormSpec:
  return NormSpec(config.normalization_layer_epsilon, (family or family_of(config)).zero_centered_norms)


def family_of(config: MaxTextConfig) -> Family:
  from maxtext.models import registry

  return registry.get(config.decoder_block)


def rope(config: MaxTextConfig, mla: bool = False, family: Family | None = None) -> RopeSpec:
  """The rotary embedding of GQA layers, or of MLA's rotary part (mla=True); family: whose pairs may be interleaved."""
  c = config
  unscaled = c.rope_type == "llama3.1" and not c.rope_use_scale  # MaxText's rope_use_scale=false: llama3.1 without its scaling
  return RopeSpec(
    kind="default" if unscaled else c.rope_type,
    theta=c.rope_max_timescale,
    linear_scaling=c.rope_linear_scaling_factor,
    llama3_factor=c.rope_scaling_factor,
    low_freq_factor=c.rope_low_freq_factor,
    high_freq_factor=c.rope_high_freq_factor,
    llama3_original_max_position=c.rope_original_max_position_embeddings,
    yarn_factor=c.rope_factor,
    yarn_original_max_position=c.original_max_position_embeddings,
    beta_fast=c.beta_fast,
    beta_slow=c.beta_slow,
    truncate=c.rope_truncate,
    attention_scaling=c.rope_attention_scaling,
    local_theta=c.local_rope_max_timescale,
    interleave=(c.rope_interleave and (mla or c.rope_type == "yarn")) or (family is not None and family.interleaved_rope),  # else split halves
    mrope_section=tuple(c.mrope_section) if c.use_mrope else (),
  )


def context_layout(config: MaxTextConfig) -> context_parallel.Layout | None:
  """How context parallelism splits the sequence, or None without it."""
  shards = axis_size(config.ici_parallelism, config.dcn_parallelism, config.mesh_axes, context_parallel.CONTEXT_AXIS)
  if shards == 1:
    return None
  return context_parallel.Layout(shards, config.context_parallel_strategy, config.context_parallel_load_balance)
