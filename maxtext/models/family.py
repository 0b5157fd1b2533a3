"""What distinguishes one decoder family from another: a small spec each family file fills."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol


class LayerShape(Protocol):
  """What a family's layer windows read: a MaxTextConfig, or the shape of a Hugging Face config being converted.
  (The config's own checks read the families, so family code names these two values, not the config.)"""

  num_decoder_layers: int
  sliding_window_size: int


def uniform_windows(shape: LayerShape) -> list[int]:
  """Every layer uses shape.sliding_window_size (0 = full attention)."""
  return [shape.sliding_window_size] * shape.num_decoder_layers


def repeating_windows(local_per_global: int) -> Callable[[LayerShape], list[int]]:
  """Groups of `local_per_global` sliding-window layers followed by one global layer (gemma2, gpt_oss: 1; gemma3: 5)."""

  def windows(shape: LayerShape) -> list[int]:
    period = local_per_global + 1
    return [shape.sliding_window_size if (i + 1) % period else 0 for i in range(shape.num_decoder_layers)]

  return windows


def period(windows: Sequence[int]) -> int:
  """The shortest p with windows[i] == windows[i % p] for every layer (1 for uniform models, 2 for gemma2, 6 for gemma3)."""
  return next(p for p in range(1, len(windows) + 1) if all(w == windows[i % p] for i, w in enumerate(windows)))


LLAMA_HF_NORMS = {"pre_attention_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}
GEMMA_HF_NORMS = {
  "pre_attention_norm": "input_layernorm",
  "post_attention_norm": "post_attention_layernorm",
  "pre_mlp_norm": "pre_feedforward_layernorm",
  "post_mlp_norm": "post_feedforward_layernorm",
}
POST_ONLY_HF_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}  # OLMo 2 and 3


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  hf_model_types: tuple[str, ...]  # Hugging Face config.json model_type values this family loads
  post_norms: bool = False  # extra RMSNorm on each branch output (Gemma 2 and 3)
  zero_centered_norms: bool = False  # norm scale applied as (1 + s) (Gemma)
  scale_embedding: bool = False  # multiply embeddings by sqrt(emb_dim) (Gemma)
  layer_windows: Callable[[LayerShape], list[int]] = uniform_windows  # sliding window per layer
  hf_norm_names: dict[str, str] = dataclasses.field(default_factory=lambda: dict(LLAMA_HF_NORMS))  # our norm -> HF module name
  mla: bool = False  # multi-head latent attention (DeepSeek) instead of grouped-query attention
  attention_sinks: bool = False  # checkpoints hold a learned sink logit per query head (gpt-oss); attention_sink may be set
  clamped_glu: bool = False  # experts use gpt-oss's clamped SwiGLU, (up + 1) * gate * act0(1.702 gate), with mlp_activations_limit
  renormalize_topk: bool = False  # the chosen experts' weights always sum to one, whatever norm_topk_prob says (Mixtral)
  pre_norms: bool = True  # RMSNorm on each branch input (OLMo 3 has only the post-branch norms)
  qk_norm_per_head: bool = True  # use_qk_norm normalises each query and key head; False: the whole projection (OLMo 3)
  attention_out_bias: bool = True  # attention_bias also biases the output projection (Qwen2: q/k/v only)
