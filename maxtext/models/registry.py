"""decoder_block -> Family: the one place that knows every family; `register` adds one (a test's, a user's)."""

from __future__ import annotations

from maxtext.models.families import (
  deepseek,
  deepseek4,
  deepseek_v32,
  gemma,
  gemma2,
  gemma3,
  gemma4,
  gpt_oss,
  llama2,
  llama4,
  mistral,
  mixtral,
  olmo3,
  qwen2,
  qwen3,
  qwen3_5,
  qwen3_5_moe,
  qwen3_moe,
  qwen3_next,
)
from maxtext.models.family import Family

FAMILIES: dict[str, Family] = {
  f.name: f
  for f in (
    llama2.FAMILY,
    mistral.FAMILY,
    mixtral.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5_moe.FAMILY,
    gemma.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    gpt_oss.FAMILY,
    deepseek.FAMILY,
    deepseek_v32.FAMILY,
    deepseek4.FAMILY,
    qwen2.FAMILY,
    olmo3.FAMILY,
    llama4.FAMILY,
    gemma4.FAMILY,
    gemma4.SMALL,
  )
}


def register(family: Family) -> Family:
  """Make `family` a valid decoder_block; a name already registered must be the same family."""
  if FAMILIES.setdefault(family.name, family) is not family:
    raise ValueError(f"a different family is already registered as {family.name!r}")
  return family


def get(decoder_block: str) -> Family:
  return FAMILIES[decoder_block]


def by_hf_model_type(model_type: str) -> Family | None:
  return next((f for f in FAMILIES.values() if model_type in f.hf_model_types), None)
