"""Llama 2, Llama 3 and Llama 3.1: pre-norm blocks, GQA, gated SiLU MLP, rotary (llama3.1 scaling via rope_type)."""

from maxtext.models.family import Family

FAMILY = Family(name="llama2", hf_model_types=("llama",))
