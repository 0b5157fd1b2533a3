"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM): the qwen3_5 family's layers, every feed-forward experts beside a gated shared
expert; the family Hugging Face's qwen3_5_moe model types load as."""

import dataclasses

from maxtext.models.families import qwen3_5

FAMILY = dataclasses.replace(qwen3_5.FAMILY, name="qwen3_5_moe", hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"))
