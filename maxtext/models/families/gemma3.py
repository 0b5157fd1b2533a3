"""Gemma 3 (text decoder): five sliding-window layers then one global layer, repeated; query/key RMSNorm, post-branch
norms, (1 + s) norm scales, embeddings scaled by sqrt(emb_dim), no soft caps. Local layers rotate with
local_rope_max_timescale, global layers with rope_max_timescale and rope_linear_scaling_factor."""

from maxtext.models.family import GEMMA_HF_NORMS, Family, standard_pattern

FAMILY = Family(
  name="gemma3",
  hf_model_types=("gemma3_text", "gemma3"),  # gemma3: the multimodal checkpoints, of which the text decoder loads
  post_norms=True,
  zero_centered_norms=True,
  scale_embedding=True,
  layer_pattern=standard_pattern(local_per_global=5),
  hf_norm_names=dict(GEMMA_HF_NORMS),
)
