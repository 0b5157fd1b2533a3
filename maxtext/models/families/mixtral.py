"""Mixtral: the Mistral block with a top-k mixture-of-experts MLP (num_experts > 1)."""

from maxtext.models.family import Family

FAMILY = Family(name="mixtral", hf_model_types=("mixtral",), renormalize_topk=True)  # a softmax over the chosen experts' logits
