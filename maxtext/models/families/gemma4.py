"""Gemma 4 (text decoder): per inhomogeneous_layer_cycle_interval layers, sliding-window layers then one global layer
with its own head width, kv heads, rope (proportional: only global_rope_proportion of its frequency pairs rotate)
and, with share_kv_projections, values equal to the keys' projection; RMSNorm on queries, keys and values (plain
scales, not 1 + s), softmax scale 1, post-branch norms, a learned scalar per layer; optional per-layer input
embeddings (hidden_size_per_layer_input) and KV-shared last layers (num_kv_shared_layers). With num_experts > 1
(Hugging Face enable_moe_block) routed experts run beside every layer's dense MLP (MaxText's one shared expert): the
router reads the un-normed branch input through its own scaled norm, softmax top-k renormalised, times a learned
per-expert scale; the experts read their own pre-norm of it; each output has its own post-norm before they add."""

import dataclasses

from maxtext.models.family import GEMMA_HF_NORMS, Family, gemma4_pattern

FAMILY = Family(
  name="gemma4",
  hf_model_types=("gemma4_text", "gemma4"),  # gemma4: the multimodal checkpoints, of which the text decoder loads
  post_norms=True,
  scale_embedding=True,
  layer_pattern=gemma4_pattern,
  hf_norm_names=dict(GEMMA_HF_NORMS),
  value_norm=True,
  softmax_scale=1.0,
  layer_scalar=True,
  gemma4_keys=True,
  renormalize_topk=True,
  experts_beside_dense_mlp=True,
)
SMALL = dataclasses.replace(FAMILY, name="gemma4_small", hf_model_types=())  # MaxText's name for the E2B/E4B files: the same layers
