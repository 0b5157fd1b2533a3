"""Qwen3.5: Qwen3-Next's layers (per inhomogeneous_layer_cycle_interval layers, Gated DeltaNet layers then one gated
full-attention layer; (1 + s) norm scales) with the linear layers' q|k|v, z, b and a projected apart. Dense (a SwiGLU
MLP per layer, Qwen3_5ForCausalLM) without experts; with num_experts > 1 experts beside a gated shared expert
(MaxText's qwen3_5 model files are the MoE models)."""

from maxtext.models.family import Family, hybrid_pattern

FAMILY = Family(
  name="qwen3_5",
  hf_model_types=("qwen3_5_text", "qwen3_5"),
  zero_centered_norms=True,
  layer_pattern=hybrid_pattern(),
  attention_output_gate=True,
  shared_expert_gate=True,
  split_linear_projections=True,
)
