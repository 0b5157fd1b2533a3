"""What distinguishes one decoder family from another: a small spec each family file fills, and its layer pattern.

A family declares, for each layer position, the layer's kind (`LayerKind`): its token mixer ('attention': grouped-query
attention, full or within a sliding window; 'mla': multi-head latent attention; 'gated_deltanet': linear attention with a fixed-size state) and its feed-forward ('dense', 'moe',
'moe_shared': experts beside always-on shared experts). The model's layer stacks, scan groups, decode caches and
parameter and FLOP counts all follow from that tuple of kinds (maxtext.models.layer_pattern).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

MIXERS = ("attention", "mla", "gated_deltanet")  # the token mixers a LayerKind may name (maxtext.models.specs.MIXERS builds each)
FEED_FORWARDS = ("dense", "moe", "moe_shared")  # the feed-forwards (maxtext.models.specs.FEED_FORWARDS builds each)


class LayerShape(Protocol):
  """What a family's layer pattern reads: a MaxTextConfig, or the shape of a Hugging Face config being converted.
  (The config's own checks read the families, so family code names these values, not the config.)"""

  num_decoder_layers: int
  sliding_window_size: int
  first_num_dense_layers: int
  num_experts: int
  shared_experts: int
  inhomogeneous_layer_cycle_interval: int


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """One layer position of a pattern: its token mixer and feed-forward.

  window: the sliding window of an attention mixer (0: full attention). It is a number, not a structure: layers
  that differ only in their window share one parameter stack and take the window as a scan input.
  """

  mixer: str = "attention"
  ffn: str = "dense"
  window: int = 0

  def __post_init__(self):
    if self.mixer not in MIXERS:
      raise ValueError(f"unknown token mixer {self.mixer!r}; one of {', '.join(MIXERS)}")
    if self.ffn not in FEED_FORWARDS:
      raise ValueError(f"unknown feed-forward {self.ffn!r}; one of {', '.join(FEED_FORWARDS)}")

  @property
  def structure(self) -> LayerKind:
    """The kind without its window: layers of equal structure have the same parameters and stack together."""
    return dataclasses.replace(self, window=0)


Pattern = Callable[[LayerShape], tuple[LayerKind, ...]]


def experts_ffn(shape: LayerShape) -> str:
  """The feed-forward of a model's expert layers: 'dense' without experts, 'moe_shared' with shared_experts, else 'moe'."""
  if shape.num_experts <= 1:
    return "dense"
  return "moe_shared" if shape.shared_experts else "moe"


def standard_pattern(mixer: str = "attention", local_per_global: int | None = None) -> Pattern:
  """The pattern of MaxText's config keys: the first first_num_dense_layers layers dense, the rest experts when
  num_experts > 1; every layer within sliding_window_size (0: full), or with local_per_global, groups of that many
  sliding-window layers followed by one full-attention layer (gemma2, gpt_oss: 1; gemma3: 5)."""

  def pattern(shape: LayerShape) -> tuple[LayerKind, ...]:
    ffn, w = experts_ffn(shape), shape.sliding_window_size
    period = None if local_per_global is None else local_per_global + 1
    return tuple(
      LayerKind(mixer, "dense" if i < shape.first_num_dense_layers else ffn, w if period is None or (i + 1) % period else 0)
      for i in range(shape.num_decoder_layers)
    )

  return pattern


def period(windows: Sequence) -> int:
  """The shortest p with windows[i] == windows[i % p] for every layer (1 for uniform models, 2 for gemma2, 6 for gemma3);
  any sequence of comparable items (windows, LayerKinds)."""
  return next(p for p in range(1, len(windows) + 1) if all(w == windows[i % p] for i, w in enumerate(windows)))


def hybrid_pattern() -> Pattern:
  """Qwen3-Next's pattern: in each run of inhomogeneous_layer_cycle_interval layers, Gated DeltaNet layers then one
  full-attention layer (HF layer_types with full_attention_interval); every feed-forward experts_ffn's."""

  def pattern(shape: LayerShape) -> tuple[LayerKind, ...]:
    ffn, every = experts_ffn(shape), shape.inhomogeneous_layer_cycle_interval
    return tuple(LayerKind("attention" if (i + 1) % every == 0 else "gated_deltanet", ffn) for i in range(shape.num_decoder_layers))

  return pattern


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
  layer_pattern: Pattern = standard_pattern()  # the kind of every layer position
  hf_norm_names: dict[str, str] = dataclasses.field(default_factory=lambda: dict(LLAMA_HF_NORMS))  # our norm -> HF module name
  attention_sinks: bool = False  # checkpoints hold a learned sink logit per query head (gpt-oss); attention_sink may be set
  clamped_glu: bool = False  # experts use gpt-oss's clamped SwiGLU, (up + 1) * gate * act0(1.702 gate), with mlp_activations_limit
  renormalize_topk: bool = False  # the chosen experts' weights always sum to one, whatever norm_topk_prob says (Mixtral)
  pre_norms: bool = True  # RMSNorm on each branch input (OLMo 3 has only the post-branch norms)
  qk_norm_per_head: bool = True  # use_qk_norm normalises each query and key head; False: the whole projection (OLMo 3)
  attention_out_bias: bool = True  # attention_bias also biases the output projection (Qwen2: q/k/v only)
  attention_output_gate: bool = False  # attention's query projection yields a sigmoid gate on its output too (Qwen3-Next)
  shared_expert_gate: bool = False  # the shared experts' output is scaled by sigmoid(x w) per token (Qwen3-Next)
  split_linear_projections: bool = False  # Gated DeltaNet projects q|k|v, z, b, a apart (Qwen3.5), not fused per key head (Qwen3-Next)

  def kinds(self, shape: LayerShape) -> tuple[LayerKind, ...]:
    """The kind of each of shape.num_decoder_layers layers."""
    kinds = tuple(self.layer_pattern(shape))
    if len(kinds) != shape.num_decoder_layers:
      raise ValueError(f"family {self.name}'s pattern gives {len(kinds)} layers for num_decoder_layers={shape.num_decoder_layers}")
    return kinds

  def layer_windows(self, shape: LayerShape) -> list[int]:
    """The sliding window of each layer (0 = full attention)."""
    return [k.window for k in self.kinds(shape)]

  def mixers(self, shape: LayerShape) -> set[str]:
    """The token mixers the model's layers use."""
    return {k.mixer for k in self.kinds(shape)}
