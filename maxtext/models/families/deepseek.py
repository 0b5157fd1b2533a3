"""DeepSeek V3: multi-head latent attention, DeepSeekMoE (shared experts, sigmoid routing with a score-correction
bias, group-limited top-k), dense first layers, YaRN rope and multi-token prediction."""

from maxtext.models.family import Family

FAMILY = Family(name="deepseek", hf_model_types=("deepseek_v3",), mla=True)
