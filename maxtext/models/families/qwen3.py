"""Qwen 3 (dense): the Llama block with RMSNorm on each query and key head (use_qk_norm). Qwen3-VL checkpoints (qwen3_vl) load
this decoder with their vision tower beside it (use_multimodal, vision_encoder_block=qwen3_vl).
"""

from maxtext.models.family import Family

FAMILY = Family(name="qwen3", hf_model_types=("qwen3", "qwen3_vl"))
