"""Gemma 2: local (sliding-window) and global attention alternate, post-branch norms, (1 + s) norm scales,
embeddings scaled by sqrt(emb_dim), soft caps on attention and final logits."""

from maxtext.config import MaxTextConfig
from maxtext.models.family import Family


def alternating_windows(config: MaxTextConfig) -> list[int]:
  """Even layers attend locally within sliding_window_size, odd layers globally."""
  return [config.sliding_window_size if i % 2 == 0 else 0 for i in range(config.num_decoder_layers)]


FAMILY = Family(
  name="gemma2",
  hf_model_types=("gemma2",),
  post_norms=True,
  zero_centered_norms=True,
  scale_embedding=True,
  layer_windows=alternating_windows,
  hf_norm_names={
    "pre_attention_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "pre_mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
  },
)
