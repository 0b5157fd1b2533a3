"""Qwen 3 (dense): the Llama block with RMSNorm on each query and key head (use_qk_norm)."""

from maxtext.models.family import Family

FAMILY = Family(name="qwen3", hf_model_types=("qwen3",))
