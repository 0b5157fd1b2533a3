"""Qwen3-MoE: the Qwen 3 block (q/k norm) with a softmax top-k mixture of experts of width base_moe_mlp_dim."""

from maxtext.models.family import Family

FAMILY = Family(name="qwen3_moe", hf_model_types=("qwen3_moe",))
