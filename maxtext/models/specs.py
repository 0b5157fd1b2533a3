"""The model's specs, built once from the config, the family and the platform policy: this module and the *_specs
modules beside it are the only model code that reads `MaxTextConfig`.

Each layer takes its spec (a small frozen dataclass defined beside the layer) and never sees the config; a family's
difference from another is a field of a spec, set here from the family (maxtext.models.family). The dtypes come
resolved in the policy (maxtext.platform.Dtypes).

Here: each decoder layer's spec (LayerSpec), the model's (ModelSpecs) and the Transformer's (DecoderSpec). The pattern's
vocabulary is MIXERS (maxtext.models.mixer_specs) and FEED_FORWARDS (maxtext.models.feed_forward_specs): they build the
spec of each token mixer and feed-forward a family's LayerKinds name (maxtext.models.decoder_layer.MODULES maps each
spec type to its layer module). The shared pieces are in maxtext.models.common_specs, the pipeline's in
maxtext.models.pipeline_specs, the vision component's in maxtext.models.vision_specs.
"""

from __future__ import annotations

import dataclasses

from maxtext.config import MaxTextConfig
from maxtext.config.adapters import adapter_specs, max_rank
from maxtext.config.sections import LoRA as LoRASection
from maxtext.layers import context_parallel
from maxtext.layers.lora import LoRASpec
from maxtext.layers.mlp import MLPSpec
from maxtext.layers.moe import MoESpec
from maxtext.layers.norms import NormSpec
from maxtext.layers.residual import ResidualSpec
from maxtext.layers.sharding import Rules
from maxtext.models.common_specs import context_layout, family_of, norm, rules
from maxtext.models.decoder_layer import LayerSpec
from maxtext.models.family import Family, LayerKind
from maxtext.models.feed_forward_specs import FEED_FORWARDS
from maxtext.models.mixer_specs import MIXERS, compressed_attention, gemma4_attention
from maxtext.models.pipeline import Schedule
from maxtext.models.pipeline_specs import pipeline
from maxtext.models.vision_specs import vision
from maxtext.vision.gemma3_encoder import Gemma3VisionSpec
from maxtext.vision.llama4_vision import Llama4VisionSpec
from maxtext.vision.qwen3_vl_encoder import Qwen3VLEncoderSpec


def residual(config: MaxTextConfig, family: Family | None = None) -> ResidualSpec:
  """The plain residual or mHC; DeepSeek V4's mHC form (hc_eps, its RMSNorm's epsilon the model's) for its family."""
  c = config
  if (family or family_of(c)).deepseek4_keys:
    return ResidualSpec(c.emb_dim, c.mhc_expansion_rate, c.sinkhorn_iterations, hc_eps=c.hc_eps, norm_eps=c.normalization_layer_epsilon)
  return ResidualSpec(c.emb_dim, c.mhc_expansion_rate, c.sinkhorn_iterations)


def lora(config: MaxTextConfig) -> LoRASpec | None:
  """The adapters of every decoder layer, or None without lora.enable_lora."""
  cfg = config.lora
  if not cfg.enable_lora:
    return None
  if cfg.max_lora_adapters == 1:
    ranks, top = (cfg.lora_rank,), cfg.lora_rank
  else:
    ranks, top = tuple(slot.rank for slot in adapter_specs(config)), max_rank(config)
  default = LoRASection.model_fields["lora_module_path"].default
  return LoRASpec(cfg.lora_module_path, cfg.lora_alpha, ranks, top, default_path=cfg.lora_module_path == default)


def layer(config: MaxTextConfig, family: Family, kind: LayerKind) -> LayerSpec:
  """One decoder layer of this kind (its window is a call argument, not part of the spec)."""
  c = config
  mixer = compressed_attention(c, kind) if kind.mixer == "compressed" else MIXERS[kind.mixer](c, family)
  ffn = FEED_FORWARDS[kind.ffn](c, family)
  if family.gemma4_keys and kind.mixer == "attention":
    mixer = gemma4_attention(c, kind, mixer)
  if kind.kv_shared and c.use_double_wide_mlp and isinstance(ffn, MLPSpec):
    ffn = dataclasses.replace(ffn, width=2 * ffn.width)
  elif kind.kv_shared and c.use_double_wide_mlp and isinstance(ffn, MoESpec) and ffn.shared is not None:  # the dense MLP beside the experts
    ffn = dataclasses.replace(ffn, shared=dataclasses.replace(ffn.shared, width=2 * ffn.shared.width))
  return LayerSpec(
    emb_dim=c.emb_dim,
    attention=mixer,
    feed_forward=ffn,
    per_layer_input=c.hidden_size_per_layer_input,
    layer_scalar=family.layer_scalar,
    norm=norm(c, family),
    post_norms=family.post_norms,
    pre_norms=family.pre_norms,
    residual=residual(c, family),
    lora=lora(c),
    num_experts=c.num_experts,
    rules=rules(c),
  )


@dataclasses.dataclass(frozen=True)
class ModelSpecs:
  """What the decoder around the layers builds from (maxtext.models.decoder)."""

  kinds: tuple[LayerKind, ...]  # the family's layer pattern: the kind of each decoder layer
  layers: tuple[LayerSpec, ...]  # each decoder layer's spec (layers of one structure share an equal spec)
  norm: NormSpec  # the final norm and the MTP modules' norms
  residual: ResidualSpec
  context: context_parallel.Layout | None  # context parallelism's sequence layout (its wrapper goes around the model call)
  pipeline: Schedule | None = None  # the pipeline schedule wrapped around the main layer stack
  vision: Gemma3VisionSpec | Qwen3VLEncoderSpec | Llama4VisionSpec | None = None  # the image encoder (use_multimodal), or None

  @property
  def layer(self) -> LayerSpec:
    """The spec the MTP modules' layers are built like: the last decoder layer with attention (a Gated DeltaNet
    layer's state has no place in an MTP module; Qwen3-Next's and Qwen3.5's MTP layers are full attention)."""
    last = next((i for i in reversed(range(len(self.kinds))) if self.kinds[i].mixer != "gated_deltanet"), len(self.kinds) - 1)
    return self.layers[last]


def model(config: MaxTextConfig, family: Family | None = None) -> ModelSpecs:
  family = family or family_of(config)
  kinds = family.kinds(config)
  by_structure = {k.structure: layer(config, family, k) for k in dict.fromkeys(kinds)}
  layers = tuple(by_structure[k.structure] for k in kinds)
  return ModelSpecs(kinds, layers, norm(config, family), residual(config, family), context_layout(config), pipeline(config), vision(config))


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
  """All the Transformer (maxtext.models.decoder) reads, read from the config once: frozen and hashable, it sits in
  the model's graphdef where the 273-field config would otherwise."""

  model: ModelSpecs  # the layers, the final norm, the residual stream, context parallelism, the pipeline
  decoder_block: str  # the family's name (for error messages)
  vocab_size: int
  emb_dim: int
  scan_layers: bool
  remat_policy: str
  scale_embedding: bool  # the family scales token embeddings by sqrt(emb_dim) (Gemma)
  logits_via_embedding: bool  # the output head is the embedding table, transposed
  normalize_embedding_logits: bool  # with tied embeddings, logits divided by sqrt(emb_dim)
  final_logits_soft_cap: float  # 0: off
  logits_dot_in_fp32: bool
  quantize_logits_proj: bool
  num_vocab_tiling: int
  mtp_num_layers: int
  load_balance_loss_weight: float  # divided by num_decoder_layers, summed over layers
  num_decoder_layers: int
  hidden_size_per_layer_input: int  # Gemma 4's per-layer inputs: each layer's width (0: none)
  vocab_size_per_layer_input: int  # their table's rows (0: vocab_size)
  rules: Rules


def decoder(config: MaxTextConfig, family: Family | None = None) -> DecoderSpec:
  """The Transformer's spec (maxtext.models.build hands the config here; the model never sees it)."""
  c = config
  family = family or family_of(c)
  return DecoderSpec(
    model=model(c, family),
    decoder_block=c.decoder_block,
    vocab_size=c.vocab_size,
    emb_dim=c.emb_dim,
    scan_layers=c.scan_layers,
    remat_policy=c.remat_policy,
    scale_embedding=family.scale_embedding,
    logits_via_embedding=c.logits_via_embedding,
    normalize_embedding_logits=c.normalize_embedding_logits,
    final_logits_soft_cap=float(c.final_logits_soft_cap or 0.0),
    logits_dot_in_fp32=c.logits_dot_in_fp32,
    quantize_logits_proj=c.quantize_logits_proj,
    num_vocab_tiling=c.num_vocab_tiling,
    mtp_num_layers=c.mtp_num_layers,
    load_balance_loss_weight=c.load_balance_loss_weight,
    num_decoder_layers=c.num_decoder_layers,
    hidden_size_per_layer_input=c.hidden_size_per_layer_input or 0,
    vocab_size_per_layer_input=c.vocab_size_per_layer_input or 0,
    rules=rules(c),
  )
