"""What distinguishes one decoder family from another: a small spec each family file fills."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from maxtext.config import MaxTextConfig


def uniform_windows(config: MaxTextConfig) -> list[int]:
  """Every layer uses config.sliding_window_size (0 = full attention)."""
  return [config.sliding_window_size] * config.num_decoder_layers


LLAMA_HF_NORMS = {"pre_attention_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  hf_model_types: tuple[str, ...]  # Hugging Face config.json model_type values this family loads
  post_norms: bool = False  # extra RMSNorm on each branch output (Gemma 2)
  zero_centered_norms: bool = False  # norm scale applied as (1 + s) (Gemma)
  scale_embedding: bool = False  # multiply embeddings by sqrt(emb_dim) (Gemma)
  layer_windows: Callable[[MaxTextConfig], list[int]] = uniform_windows  # sliding window per layer
  hf_norm_names: dict[str, str] = dataclasses.field(default_factory=lambda: dict(LLAMA_HF_NORMS))  # our norm -> HF module name
  mla: bool = False  # multi-head latent attention (DeepSeek) instead of grouped-query attention
