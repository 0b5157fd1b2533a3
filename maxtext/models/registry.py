"""decoder_block -> Family: the one place that knows every family."""

from __future__ import annotations

from maxtext.models.families import deepseek, gemma2, gemma3, gpt_oss, llama2, mistral, mixtral, olmo3, qwen2, qwen3, qwen3_moe
from maxtext.models.family import Family

FAMILIES: dict[str, Family] = {
  f.name: f
  for f in (
    llama2.FAMILY,
    mistral.FAMILY,
    mixtral.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    gpt_oss.FAMILY,
    deepseek.FAMILY,
    qwen2.FAMILY,
    olmo3.FAMILY,
  )
}


def get(decoder_block: str) -> Family:
  return FAMILIES[decoder_block]


def by_hf_model_type(model_type: str) -> Family | None:
  return next((f for f in FAMILIES.values() if model_type in f.hf_model_types), None)
