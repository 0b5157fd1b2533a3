"""Mistral: the Llama block with an optional sliding window on every layer."""

from maxtext.models.family import Family

FAMILY = Family(name="mistral", hf_model_types=("mistral",))
