"""DeepSeek V4: compressed attention (a sliding window in every layer; compressed sparse attention with a lightning
indexer, or heavily compressed attention, per compress_ratios), hash-routed experts in the first first_num_hash_layers
layers and sqrtsoftplus-routed ones after, each beside a shared expert, DeepSeek V4's clamped SwiGLU
(mlp_activations_limit), and mHC in V4's form (hc_eps) with a learned collapse of the streams before the final norm."""

from maxtext.models.family import Family, deepseek4_pattern

FAMILY = Family(name="deepseek4", hf_model_types=("deepseek_v4",), layer_pattern=deepseek4_pattern, deepseek4_keys=True)
