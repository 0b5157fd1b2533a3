"""Gemma 2: local (sliding-window) and global attention alternate, post-branch norms, (1 + s) norm scales,
embeddings scaled by sqrt(emb_dim), soft caps on attention and final logits."""

from maxtext.models.family import GEMMA_HF_NORMS, Family, standard_pattern

FAMILY = Family(
  name="gemma2",
  hf_model_types=("gemma2",),
  post_norms=True,
  zero_centered_norms=True,
  scale_embedding=True,
  layer_pattern=standard_pattern(local_per_global=1),  # even layers (0, 2, ...) within sliding_window_size, odd layers full
  hf_norm_names=dict(GEMMA_HF_NORMS),
)
