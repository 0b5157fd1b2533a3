"""DeepSeek V3.2: DeepSeek V3 with DeepSeek Sparse Attention, MLA over the top-k keys of a lightning indexer in every
layer (maxtext.layers.mla_sparse; MaxText's use_indexer and indexer_* keys)."""

from maxtext.models.family import Family, standard_pattern

# Sparse MLA in every layer; the first first_num_dense_layers layers dense, the rest experts (beside shared_experts).
FAMILY = Family(name="deepseek_v32", hf_model_types=("deepseek_v32",), layer_pattern=standard_pattern(mixer="mla_sparse"))
