"""Gemma 2: local (sliding-window) and global attention alternate, post-branch norms, (1 + s) norm scales,
embeddings scaled by sqrt(emb_dim), soft caps on attention and final logits."""

from maxtext.models.family import GEMMA_HF_NORMS, Family, repeating_windows

# Even layers (0, 2, ...) attend locally within sliding_window_size, odd layers globally.
alternating_windows = repeating_windows(1)

FAMILY = Family(
  name="gemma2",
  hf_model_types=("gemma2",),
  post_norms=True,
  zero_centered_norms=True,
  scale_embedding=True,
  layer_windows=alternating_windows,
  hf_norm_names=dict(GEMMA_HF_NORMS),
)
