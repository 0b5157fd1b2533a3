"""Qwen2 and Qwen2.5: the Llama block with biases on the query, key and value projections (none on the output)."""

from maxtext.models.family import Family

FAMILY = Family(name="qwen2", hf_model_types=("qwen2",), attention_out_bias=False)
