"""DeepSeek V3: multi-head latent attention, DeepSeekMoE (shared experts, sigmoid routing with a score-correction
bias, group-limited top-k), dense first layers, YaRN rope and multi-token prediction."""

from maxtext.models.family import Family, standard_pattern

# MLA in every layer; the first first_num_dense_layers layers dense, the rest experts (beside shared_experts).
FAMILY = Family(name="deepseek", hf_model_types=("deepseek_v3",), layer_pattern=standard_pattern(mixer="mla"))
