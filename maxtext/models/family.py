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

# The token mixers a LayerKind may name (maxtext.models.mixer_specs.MIXERS builds each); mla_sparse: MLA over a lightning
# indexer's top-k keys (DeepSeek V3.2).
# compressed: DeepSeek V4's attention over a sliding window plus, with a compress rate, compressed keys
# (maxtext.layers.compressed_attention; the kind's variant is its Hugging Face layer type).
MIXERS = ("attention", "mla", "gated_deltanet", "mla_sparse", "compressed")
# the feed-forwards (maxtext.models.feed_forward_specs.FEED_FORWARDS builds each); moe_hash: experts fixed per token id (DeepSeek V4's
# first layers) beside shared experts
FEED_FORWARDS = ("dense", "moe", "moe_shared", "moe_hash")


class LayerShape(Protocol):
  """What a family's layer pattern reads: a MaxTextConfig, or the shape of a Hugging Face config being converted.
  (The config's own checks read the families, so family code names these values, not the config.)"""

  num_decoder_layers: int
  sliding_window_size: int
  first_num_dense_layers: int
  num_experts: int
  shared_experts: int
  inhomogeneous_layer_cycle_interval: int
  interleave_moe_layer_step: int  # llama4
  nope_layer_interval: int  # llama4
  chunk_attn_window_size: int  # llama4
  compress_ratios: list[int]  # deepseek4
  csa_compress_ratio: int  # deepseek4
  first_num_hash_layers: int  # deepseek4


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """One layer position of a pattern: its token mixer and feed-forward.

  window: the sliding window of an attention mixer (0: full attention). It is a number, not a structure: layers
  that differ only in their window share one parameter stack and take the window as a scan input.
  chunk: chunked local attention (Llama 4): each token attends causally within its chunk of `chunk` positions
  (0: none). Like the window, a number: the layer receives both as one signed `span` (window, or -chunk).
  """

  mixer: str = "attention"
  ffn: str = "dense"
  window: int = 0
  chunk: int = 0
  variant: str = ""  # a family's structural variant of the layer (gemma4: 'global', full attention with its own head dims and rope)
  kv_shared: bool = False  # attends with the keys and values of the last earlier unshared layer of the same window; no key/value projections
  compress: int = 0  # a compressed mixer's compress rate (0: sliding window only); part of the structure (its compressor's shape)

  def __post_init__(self):
    if self.mixer not in MIXERS:
      raise ValueError(f"unknown token mixer {self.mixer!r}; one of {', '.join(MIXERS)}")
    if self.ffn not in FEED_FORWARDS:
      raise ValueError(f"unknown feed-forward {self.ffn!r}; one of {', '.join(FEED_FORWARDS)}")
    if self.window and self.chunk:
      raise ValueError("a layer attends within a sliding window or within chunks, not both")

  @property
  def structure(self) -> LayerKind:
    """The kind without its window or chunk: layers of equal structure have the same parameters and stack together."""
    return dataclasses.replace(self, window=0, chunk=0)

  @property
  def span(self) -> int:
    """What the layer's attention receives per layer (a scan input when it varies): the sliding window (> 0), minus
    the chunk (< 0), or 0 for full causal attention (maxtext.layers.xla_attention.span_mask reads it)."""
    return -self.chunk if self.chunk else self.window


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


def llama4_pattern(shape: LayerShape) -> tuple[LayerKind, ...]:
  """Llama 4's pattern: layer i is MoE (routed experts beside shared_experts) when (i + 1) % interleave_moe_layer_step
  == 0, else a dense MLP; NoPE with full attention when (i + 1) % nope_layer_interval == 0, else rope attending within
  chunks of chunk_attn_window_size (Hugging Face moe_layers, no_rope_layers and layer_types)."""
  ffn, step, nope = experts_ffn(shape), shape.interleave_moe_layer_step, shape.nope_layer_interval
  return tuple(
    LayerKind("attention", ffn if (i + 1) % step == 0 else "dense", chunk=0 if nope > 0 and (i + 1) % nope == 0 else shape.chunk_attn_window_size)
    for i in range(shape.num_decoder_layers)
  )


LLAMA_HF_NORMS = {"pre_attention_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}
GEMMA_HF_NORMS = {
  "pre_attention_norm": "input_layernorm",
  "post_attention_norm": "post_attention_layernorm",
  "pre_mlp_norm": "pre_feedforward_layernorm",
  "post_mlp_norm": "post_feedforward_layernorm",
}


def gemma4_pattern(shape: LayerShape) -> tuple[LayerKind, ...]:
  """Gemma 4's pattern: per inhomogeneous_layer_cycle_interval layers, sliding-window layers then one global layer
  (variant 'global'); the last layer is global (as transformers forces it); the last num_kv_shared_layers layers
  reuse the keys and values of the last earlier unshared layer of their kind."""
  n, every, w = shape.num_decoder_layers, shape.inhomogeneous_layer_cycle_interval, shape.sliding_window_size
  shared_from = n - getattr(shape, "num_kv_shared_layers", 0)
  ffn = experts_ffn(shape)

  def kind(i: int) -> LayerKind:
    full = (i + 1) % every == 0 or i == n - 1
    return LayerKind("attention", ffn, 0 if full else w, variant="global" if full else "", kv_shared=i >= shared_from)

  return tuple(kind(i) for i in range(n))


def deepseek4_pattern(shape: LayerShape) -> tuple[LayerKind, ...]:
  """DeepSeek V4's pattern: layer i attends with compress rate compress_ratios[i] (0: sliding window only, sliding_attention;
  csa_compress_ratio: compressed sparse attention with the indexer; any other: heavily compressed attention), every
  layer within sliding_window_size; the first first_num_hash_layers layers route by token id (hash MoE), the rest
  by score; shared experts beside both."""
  ratios, csa, hashed = shape.compress_ratios, shape.csa_compress_ratio, shape.first_num_hash_layers

  def kind(i: int, rate: int) -> LayerKind:
    layer_type = "sliding_attention" if rate == 0 else "compressed_sparse_attention" if rate == csa else "heavily_compressed_attention"
    return LayerKind("compressed", "moe_hash" if i < hashed else "moe_shared", shape.sliding_window_size, variant=layer_type, compress=rate)

  return tuple(kind(i, rate) for i, rate in enumerate(ratios))


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
  nope_full_layers: bool = False  # Llama 4: layers of full attention (span 0) take no rope and no qk norm, and temperature_tuning
  l2_qk_norm: bool = False  # use_qk_norm is a weightless L2 (RMS) norm of q and k after rope (Llama 4), not a learned RMSNorm
  interleaved_rope: bool = False  # rotary pairs are neighbouring features (x[2i], x[2i+1]) whatever the rope type (Llama 4)
  expert_input_weights: bool = False  # the router's top-1 sigmoid weight scales the expert's input, not its output (Llama 4)
  value_norm: bool = False  # an RMSNorm on each value head (Gemma 4; its scale per v_norm_with_scale)
  softmax_scale: float | None = None  # a fixed attention softmax scale (Gemma 4: 1, its query norm sizes the logits); None: query_pre_attn_scalar's
  layer_scalar: bool = False  # each layer's output is multiplied by a learned scalar (Gemma 4's layer_scalar)
  gemma4_keys: bool = (
    False  # Gemma 4's keys apply: 'global' layers' global_head_dim, global_num_kv_heads, share_kv_projections and global_rope_*, per-layer inputs, KV sharing
  )
  experts_beside_dense_mlp: bool = (
    False  # Gemma 4: the experts run beside the layer's dense MLP (mlp_dim wide: the one shared expert), router and experts read the un-normed input
  )
  deepseek4_keys: bool = False  # DeepSeek V4's keys apply: compress_ratios, o_groups, first_num_hash_layers, hc_eps, ... (its clamped SwiGLU, mHC form)
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

  def layer_spans(self, shape: LayerShape) -> list[int]:
    """What each layer's attention receives: its window (> 0), minus its chunk (< 0), or 0 (LayerKind.span)."""
    return [k.span for k in self.kinds(shape)]

  def mixers(self, shape: LayerShape) -> set[str]:
    """The token mixers the model's layers use."""
    return {k.mixer for k in self.kinds(shape)}
