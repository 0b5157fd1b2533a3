"""Qwen3-MoE: the Qwen 3 block (q/k norm) with a softmax top-k mixture of experts of width base_moe_mlp_dim. Qwen3-VL checkpoints (qwen3_vl_moe) load
this decoder with their vision tower beside it (use_multimodal, vision_encoder_block=qwen3_vl).
"""

from maxtext.models.family import Family

FAMILY = Family(name="qwen3_moe", hf_model_types=("qwen3_moe", "qwen3_vl_moe"))
