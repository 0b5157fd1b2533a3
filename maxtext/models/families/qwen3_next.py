"""Qwen3-Next: per inhomogeneous_layer_cycle_interval layers (4), Gated DeltaNet linear-attention layers then one gated
full-attention layer (sigmoid output gate, partial rope, query/key RMSNorm); (1 + s) norm scales; a mixture of
experts beside one shared expert whose output a sigmoid gate scales."""

from maxtext.models.family import Family, hybrid_pattern

FAMILY = Family(
  name="qwen3_next",
  hf_model_types=("qwen3_next",),
  zero_centered_norms=True,
  layer_pattern=hybrid_pattern(),
  attention_output_gate=True,
  shared_expert_gate=True,
)
