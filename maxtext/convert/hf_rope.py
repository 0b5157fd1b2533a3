"""Rotary embedding keys both ways: a config.json's rope_parameters (or rope_theta + rope_scaling) <-> maxtext's rope keys."""

from __future__ import annotations

from typing import Any

from maxtext.convert.hf_fields import HFFields
from maxtext.errors import ConfigError
from maxtext.layers.rope import yarn_mscale

# The run's config, read by attribute (a maxtext.config.MaxTextConfig; not imported: the config's loader reads this module)
Config = Any


def rope_overrides(hf: HFFields) -> dict[str, Any]:
  """Rotary keys of a config.json: rope_parameters (transformers 5) or rope_theta + rope_scaling; Gemma 3's per-layer-type
  parameters give the global layers' rope and local_rope_max_timescale."""
  scaling, parameters = hf.section("rope_scaling"), hf.section("rope_parameters")
  merged = {**scaling.values, **parameters.values}
  names = {k: ("rope_parameters." if k in parameters.values else "rope_scaling.") + k for k in merged}
  params = HFFields(merged, hf.source, "rope_parameters." if parameters.values else "rope_scaling.", names)  # a missing key: the section set
  theta, local_theta = hf.number("rope_theta", 10_000.0, positive=True), hf.number("rope_local_base_freq", None, positive=True)
  local: HFFields | None = None
  if "full_attention" in merged or "sliding_attention" in merged:  # per layer type (gemma3)
    local, params = params.section("sliding_attention"), params.section("full_attention")
  elif local_theta is not None:
    local = HFFields({}, hf.source)
  elif hf.values.get("model_type") == "olmo3":  # transformers 5 applies a legacy rope_scaling to Olmo3's full layers only
    local = HFFields({"rope_theta": theta}, hf.source)
  out: dict[str, Any] = {"rope_max_timescale": params.number("rope_theta", theta, positive=True)}
  kind = params.text("rope_type", None) or params.text("type", "default")
  if kind == "llama3":
    out.update(
      rope_type="llama3.1",
      rope_scaling_factor=params.number("factor", positive=True),
      rope_low_freq_factor=params.number("low_freq_factor", positive=True),
      rope_high_freq_factor=params.number("high_freq_factor", positive=True),
      rope_original_max_position_embeddings=params.int("original_max_position_embeddings"),
    )
  elif kind == "yarn":
    out.update(_yarn(params))
  elif kind == "linear":
    out["rope_linear_scaling_factor"] = params.number("factor", positive=True)
  elif kind != "default":
    raise ConfigError(f"rope type '{kind}' in config.json is not supported; supported: default, linear, llama3, yarn")
  if local is not None:
    if (local.text("rope_type", None) or local.text("type", "default")) != "default":
      raise ConfigError("config.json scales the sliding-window layers' rope; maxtext's local layers use plain rope (local_rope_max_timescale)")
    out["local_rope_max_timescale"] = local.number("rope_theta", local_theta or 10_000.0, positive=True)
  return out


def _yarn(params: HFFields) -> dict[str, Any]:
  """HF yarn parameters -> rope_factor, beta_*, original_max_position_embeddings, mscale, rope_attention_scaling, rope_truncate.

  HF scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (1 when they are
  equal, as in DeepSeek V3) and DeepSeek's softmax scale by mscale(factor, mscale_all_dim)^2; without them cos/sin
  get mscale(factor) and the softmax scale is unchanged.
  """
  factor = params.number("factor", positive=True)
  if not factor.is_integer():
    raise ConfigError(f"yarn factor {factor} in config.json is not a whole number; maxtext's rope_factor is an integer")
  m, m_all = params.number("mscale", None, minimum=0), params.number("mscale_all_dim", None, minimum=0)
  attention_factor = params.number("attention_factor", None, positive=True)
  if attention_factor is not None and (m or m_all or abs(attention_factor - yarn_mscale(factor)) > 1e-6):
    raise ConfigError(
      f"yarn attention_factor {attention_factor} in config.json is not supported; maxtext derives it from factor and mscale "
      f"(0.1 ln(factor) + 1 = {yarn_mscale(factor)}): remove it"
    )
  if m and m_all and m != m_all:
    raise ConfigError(f"yarn mscale {m} != mscale_all_dim {m_all} in config.json is not supported; maxtext has one mscale")
  both = bool(m and m_all)
  return {
    "rope_type": "yarn",
    "rope_factor": int(factor),
    "original_max_position_embeddings": params.int("original_max_position_embeddings"),
    "beta_fast": params.int("beta_fast", 32),
    "beta_slow": params.int("beta_slow", 1),
    "mscale": m_all or 0.0,
    "rope_attention_scaling": not both,
    "rope_truncate": params.flag("truncate", True),
  }


def rope_export(c: Config, mla: bool = False) -> dict[str, Any]:
  """rope_parameters of a config.json: default, linear, llama3 or yarn (MLA's yarn: DeepSeek's mscale form or cos/sin scaling)."""
  rope: dict[str, Any] = {"rope_theta": c.rope_max_timescale, "rope_type": "default"}
  if c.rope_type == "llama3.1":
    rope.update(
      rope_type="llama3",
      factor=c.rope_scaling_factor,
      low_freq_factor=c.rope_low_freq_factor,
      high_freq_factor=c.rope_high_freq_factor,
      original_max_position_embeddings=c.rope_original_max_position_embeddings,
    )
  elif c.rope_type == "yarn":
    rope.update(
      rope_type="yarn",
      factor=float(c.rope_factor),
      original_max_position_embeddings=c.original_max_position_embeddings,
      beta_fast=c.beta_fast,
      beta_slow=c.beta_slow,
      truncate=c.rope_truncate,
    )
    if mla and not c.rope_attention_scaling:
      if c.mscale == 0:
        raise ConfigError("yarn with mscale=0 and rope_attention_scaling=false has no Hugging Face equivalent")
      rope.update(mscale=c.mscale, mscale_all_dim=c.mscale)
    elif not c.rope_attention_scaling or (mla and c.mscale != 0):
      raise ConfigError("this yarn setting (rope_attention_scaling, mscale) has no Hugging Face equivalent; export needs yarn's default cos/sin scaling")
  elif c.rope_linear_scaling_factor != 1.0:
    rope.update(rope_type="linear", factor=c.rope_linear_scaling_factor)
  return rope
