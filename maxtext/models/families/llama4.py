"""Llama 4 (text decoder): every interleave_moe_layer_step-th layer a top-1 mixture of experts whose sigmoid router
weight scales the expert's input, beside one shared expert (dense MLPs of mlp_dim between); rope layers attend within
chunks of chunk_attn_window_size positions with interleaved-pair rope and, with use_qk_norm, a weightless L2 norm of
queries and keys; every nope_layer_interval-th layer attends globally without rope, its queries temperature-tuned."""

from maxtext.models.family import Family, llama4_pattern

FAMILY = Family(
  name="llama4",
  hf_model_types=("llama4_text", "llama4"),  # llama4: the multimodal checkpoints, of which the text decoder loads
  layer_pattern=llama4_pattern,
  nope_full_layers=True,
  l2_qk_norm=True,
  interleaved_rope=True,
  expert_input_weights=True,
)
