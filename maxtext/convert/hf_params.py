"""Hugging Face tensor names and layouts <-> maxtext parameter paths and layouts.

maxtext paths are '/'-joined nnx state paths. With scan_layers the layer parameters
are stacked under 'layers/<name>' with a leading layer axis; unscanned they live
under 'layers/<i>/<name>'. The conversions below are exact (transposes and
reshapes only), so HF -> maxtext -> HF round trips bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from maxtext.config import MaxTextConfig
from maxtext.convert import hf_deepseek_v4, hf_qwen3_vl, mxfp4
from maxtext.errors import ConfigError, shorten
from maxtext.models import layer_pattern, registry
from maxtext.models.family import LayerKind
from maxtext.vision import convert as vision_convert

Array = np.ndarray


@dataclasses.dataclass(frozen=True)
class Rule:
  ours: str  # path under a layer (or global)
  hf: str  # HF name; '{j}' for an expert index
  to_ours: Callable[[Array], Array]
  to_hf: Callable[[Array], Array]
  experts: bool = False  # ours is stacked over experts [n, ...]; hf has one tensor per expert
  part: tuple[int, int] | None = None  # (k, n): ours is to_ours(hf)[..., k::n], the k-th of n interleaved column sets (gpt-oss gate_up)


def _identity(x: Array) -> Array:
  return x


def _transpose(x: Array) -> Array:
  return np.ascontiguousarray(x.T)


def _linear_to_ours(in_shape: tuple[int, ...], out_shape: tuple[int, ...], w: Array) -> Array:
  return np.ascontiguousarray(w.T).reshape(*in_shape, *out_shape)


def _linear_to_hf(in_shape: tuple[int, ...], out_shape: tuple[int, ...], w: Array) -> Array:
  return np.ascontiguousarray(w.reshape(int(np.prod(in_shape)), int(np.prod(out_shape))).T)


def _linear(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[Callable, Callable]:
  """HF Linear weight [out, in] <-> our kernel in_shape + out_shape (partials, so that a sliced reader can see the shapes)."""
  return functools.partial(_linear_to_ours, in_shape, out_shape), functools.partial(_linear_to_hf, in_shape, out_shape)


def _bias_to_ours(shape: tuple[int, ...], b: Array) -> Array:
  return np.ascontiguousarray(b).reshape(shape)


def _bias_to_hf(shape: tuple[int, ...], b: Array) -> Array:
  return np.ascontiguousarray(b).reshape(-1)


def _bias(shape: tuple[int, ...]) -> tuple[Callable, Callable]:
  """HF bias [prod(shape)] <-> our bias of shape."""
  return functools.partial(_bias_to_ours, shape), functools.partial(_bias_to_hf, shape)


def _conv_to_ours(w: Array) -> Array:
  return np.ascontiguousarray(w[:, 0, :].T)


def _conv_to_hf(w: Array) -> Array:
  return np.ascontiguousarray(w.T[:, None, :])


def _gated_deltanet_rules(c: MaxTextConfig) -> list[Rule]:
  """Qwen3NextGatedDeltaNet (linear_attn.*): the fused projections keep HF's per-key-head order; Qwen3_5GatedDeltaNet's
  split ones are plain linear layers; conv1d [C, 1, K] is our [K, C]."""
  e, hk, dk, hv, dv = c.emb_dim, c.gdn_num_key_heads, c.gdn_key_head_dim, c.gdn_num_value_heads, c.gdn_value_head_dim
  r = hv // hk
  if registry.get(c.decoder_block).split_linear_projections:  # Qwen3_5GatedDeltaNet
    projections = [
      Rule("attention/in_proj_qkv/kernel", "linear_attn.in_proj_qkv.weight", _transpose, _transpose),
      Rule("attention/in_proj_z/kernel", "linear_attn.in_proj_z.weight", *_linear((e,), (hv, dv))),
      Rule("attention/in_proj_b/kernel", "linear_attn.in_proj_b.weight", _transpose, _transpose),
      Rule("attention/in_proj_a/kernel", "linear_attn.in_proj_a.weight", _transpose, _transpose),
    ]
  else:
    projections = [
      Rule("attention/in_proj_qkvz/kernel", "linear_attn.in_proj_qkvz.weight", *_linear((e,), (hk, 2 * dk + 2 * r * dv))),
      Rule("attention/in_proj_ba/kernel", "linear_attn.in_proj_ba.weight", *_linear((e,), (hk, 2 * r))),
    ]
  return projections + [
    Rule("attention/conv", "linear_attn.conv1d.weight", _conv_to_ours, _conv_to_hf),
    Rule("attention/A_log", "linear_attn.A_log", _identity, _identity),
    Rule("attention/dt_bias", "linear_attn.dt_bias", _identity, _identity),
    Rule("attention/norm/scale", "linear_attn.norm.weight", _identity, _identity),
    Rule("attention/out_proj/kernel", "linear_attn.out_proj.weight", *_linear((hv, dv), (e,))),
  ]


def _indexer_rules(c: MaxTextConfig) -> list[Rule]:
  """DeepSeek Sparse Attention's lightning indexer (DeepseekV32's self_attn.indexer)."""
  e, h, d = c.emb_dim, c.indexer_n_heads, c.indexer_head_dim
  return [
    Rule("attention/indexer/wq_b/kernel", "self_attn.indexer.wq_b.weight", *_linear((c.q_lora_rank,), (h, d))),
    Rule("attention/indexer/wk/kernel", "self_attn.indexer.wk.weight", *_linear((e,), (d,))),
    Rule("attention/indexer/k_norm/scale", "self_attn.indexer.k_norm.weight", _identity, _identity),
    Rule("attention/indexer/k_norm/bias", "self_attn.indexer.k_norm.bias", _identity, _identity),
    Rule("attention/indexer/weights_proj/kernel", "self_attn.indexer.weights_proj.weight", *_linear((e,), (h,))),
  ]


def _attention_rules(c: MaxTextConfig, mixer: str = "attention") -> list[Rule]:
  e, h, kv, d = c.emb_dim, c.num_query_heads, c.num_kv_heads, c.head_dim
  if mixer == "gated_deltanet":
    return _gated_deltanet_rules(c)
  if mixer == "mla_sparse":
    return _attention_rules(c, "mla") + _indexer_rules(c)
  if mixer == "mla":
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    rules = []
    if c.q_lora_rank == 0:
      rules.append(Rule("attention/wq/kernel", "self_attn.q_proj.weight", *_linear((e,), (h, qk))))
    else:
      rules += [
        Rule("attention/wq_a/kernel", "self_attn.q_a_proj.weight", *_linear((e,), (c.q_lora_rank,))),
        Rule("attention/q_norm/scale", "self_attn.q_a_layernorm.weight", _identity, _identity),
        Rule("attention/wq_b/kernel", "self_attn.q_b_proj.weight", *_linear((c.q_lora_rank,), (h, qk))),
      ]
    return rules + [
      Rule("attention/wkv_a/kernel", "self_attn.kv_a_proj_with_mqa.weight", *_linear((e,), (c.kv_lora_rank + c.qk_rope_head_dim,))),
      Rule("attention/kv_norm/scale", "self_attn.kv_a_layernorm.weight", _identity, _identity),
      Rule("attention/wkv_b/kernel", "self_attn.kv_b_proj.weight", *_linear((c.kv_lora_rank,), (h, c.qk_nope_head_dim + c.v_head_dim))),
      Rule("attention/out/kernel", "self_attn.o_proj.weight", *_linear((h, c.v_head_dim), (e,))),
    ]
  rules = [
    Rule("attention/query/kernel", "self_attn.q_proj.weight", *_linear((e,), (h, 2 * d if registry.get(c.decoder_block).attention_output_gate else d))),
    Rule("attention/key/kernel", "self_attn.k_proj.weight", *_linear((e,), (kv, d))),
    Rule("attention/value/kernel", "self_attn.v_proj.weight", *_linear((e,), (kv, d))),
    Rule("attention/out/kernel", "self_attn.o_proj.weight", *_linear((h, d), (e,))),
  ]
  if c.attention_bias:
    rules += [
      Rule("attention/query/bias", "self_attn.q_proj.bias", *_bias((h, d))),
      Rule("attention/key/bias", "self_attn.k_proj.bias", *_bias((kv, d))),
      Rule("attention/value/bias", "self_attn.v_proj.bias", *_bias((kv, d))),
    ]
    if registry.get(c.decoder_block).attention_out_bias:
      rules.append(Rule("attention/out/bias", "self_attn.o_proj.bias", _identity, _identity))
  if c.attention_sink:
    rules.append(Rule("attention/sinks", "self_attn.sinks", _identity, _identity))
  if c.use_qk_norm and not registry.get(c.decoder_block).l2_qk_norm:  # Llama 4's L2 norm has no weights
    rules += [Rule("attention/query_norm/scale", "self_attn.q_norm.weight", _identity, _identity)]
    rules += [Rule("attention/key_norm/scale", "self_attn.k_norm.weight", _identity, _identity)]
  return rules


def _gpt_oss_moe_rules() -> list[Rule]:
  """gpt-oss experts: stacked tensors, gate and up interleaved column by column in gate_up_proj [E, in, 2 x mlp]."""
  return [
    Rule("mlp/gate/kernel", "mlp.router.weight", _transpose, _transpose),
    Rule("mlp/gate/bias", "mlp.router.bias", _identity, _identity),
    Rule("mlp/wi_0", "mlp.experts.gate_up_proj", _identity, _identity, part=(0, 2)),
    Rule("mlp/wi_1", "mlp.experts.gate_up_proj", _identity, _identity, part=(1, 2)),
    Rule("mlp/wi_0_bias", "mlp.experts.gate_up_proj_bias", _identity, _identity, part=(0, 2)),
    Rule("mlp/wi_1_bias", "mlp.experts.gate_up_proj_bias", _identity, _identity, part=(1, 2)),
    Rule("mlp/wo", "mlp.experts.down_proj", _identity, _identity),
    Rule("mlp/wo_bias", "mlp.experts.down_proj_bias", _identity, _identity),
  ]


def _halves_to_interleaved(x: Array) -> Array:
  """[..., 2 n] of two halves -> [..., 2 n] with the halves' columns interleaved (so Rule.part takes each half)."""
  return np.ascontiguousarray(x.reshape(*x.shape[:-1], 2, -1).swapaxes(-1, -2).reshape(x.shape))


def _interleaved_to_halves(x: Array) -> Array:
  return np.ascontiguousarray(x.reshape(*x.shape[:-1], -1, 2).swapaxes(-1, -2).reshape(x.shape))


def _llama4_moe_rules() -> list[Rule]:
  """Llama 4 experts: stacked tensors, gate then up halves in gate_up_proj [E, in, 2 x mlp]; a router and a shared expert."""
  return [
    Rule("mlp/gate/kernel", "feed_forward.router.weight", _transpose, _transpose),
    Rule("mlp/wi_0", "feed_forward.experts.gate_up_proj", _halves_to_interleaved, _interleaved_to_halves, part=(0, 2)),
    Rule("mlp/wi_1", "feed_forward.experts.gate_up_proj", _halves_to_interleaved, _interleaved_to_halves, part=(1, 2)),
    Rule("mlp/wo", "feed_forward.experts.down_proj", _identity, _identity),
    *_dense_mlp_rules("mlp/shared_experts", "feed_forward.shared_expert"),
  ]


def _dense_mlp_rules(ours: str, hf: str) -> list[Rule]:
  return [
    Rule(f"{ours}/wi_0/kernel", f"{hf}.gate_proj.weight", _transpose, _transpose),
    Rule(f"{ours}/wi_1/kernel", f"{hf}.up_proj.weight", _transpose, _transpose),
    Rule(f"{ours}/wo/kernel", f"{hf}.down_proj.weight", _transpose, _transpose),
  ]


def _layer_rules(c: MaxTextConfig, kind: LayerKind) -> list[Rule]:
  """Rules of one decoder layer of this kind."""
  if len(c.mlp_activations) != 2:
    raise ConfigError("a single MLP activation has no Hugging Face layout; use mlp_activations=[<act>, linear]")
  if registry.get(c.decoder_block).gemma4_keys:
    return _gemma4_layer_rules(c, kind)
  rules = _attention_rules(c, kind.mixer)
  dense = kind.ffn == "dense"
  for ours, hf in registry.get(c.decoder_block).hf_norm_names.items():
    rules.append(Rule(f"{ours}/scale", f"{hf}.weight", _identity, _identity))
  if c.num_experts == 1 or dense:
    return rules + _dense_mlp_rules("mlp", "feed_forward" if c.decoder_block == "llama4" else "mlp")
  if c.decoder_block == "llama4":
    return rules + _llama4_moe_rules()
  if c.decoder_block == "gpt_oss":
    return rules + _gpt_oss_moe_rules()
  if c.decoder_block == "mixtral":
    return rules + [
      Rule("mlp/gate/kernel", "block_sparse_moe.gate.weight", _transpose, _transpose),
      Rule("mlp/wi_0", "block_sparse_moe.experts.{j}.w1.weight", _transpose, _transpose, experts=True),
      Rule("mlp/wi_1", "block_sparse_moe.experts.{j}.w3.weight", _transpose, _transpose, experts=True),
      Rule("mlp/wo", "block_sparse_moe.experts.{j}.w2.weight", _transpose, _transpose, experts=True),
    ]
  rules += [
    Rule("mlp/gate/kernel", "mlp.gate.weight", _transpose, _transpose),
    Rule("mlp/wi_0", "mlp.experts.{j}.gate_proj.weight", _transpose, _transpose, experts=True),
    Rule("mlp/wi_1", "mlp.experts.{j}.up_proj.weight", _transpose, _transpose, experts=True),
    Rule("mlp/wo", "mlp.experts.{j}.down_proj.weight", _transpose, _transpose, experts=True),
  ]
  if c.routed_bias:
    rules.append(Rule("mlp/routed_bias", "mlp.gate.e_score_correction_bias", _identity, _identity))
  if c.shared_experts:
    hf_shared = "mlp.shared_expert" if registry.get(c.decoder_block).shared_expert_gate else "mlp.shared_experts"
    rules += _dense_mlp_rules("mlp/shared_experts", hf_shared)
    if registry.get(c.decoder_block).shared_expert_gate:
      rules.append(Rule("mlp/shared_expert_gate/kernel", "mlp.shared_expert_gate.weight", _transpose, _transpose))
  return rules


def _stacks(c: MaxTextConfig) -> list[tuple[str, int, int, bool]]:
  """(our collection, first HF layer index, number of layers, dense) for each layer stack of a model whose stacks each
  hold one layer structure (maxtext.convert.hf_dir's sliced reads)."""
  n_dense = c.first_num_dense_layers
  moe = ("layers", n_dense, c.num_decoder_layers - n_dense, False)
  return [("dense_layers", 0, n_dense, True), moe] if n_dense else [moe]


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where HF layer `hf_index` sits among our parameters: under `prefix` ('layers', 'layers/<j>' of a block,
  'layers/<i>' unscanned, 'layers_remainder/<i>'), at `index` of the stacked axis (None: not stacked)."""

  hf_index: int
  kind: LayerKind
  prefix: str
  index: int | None


def _slots(c: MaxTextConfig) -> list[Slot]:
  """Every decoder layer's place in the model's stacks (maxtext.models.layer_pattern), bottom to top."""
  kinds = registry.get(c.decoder_block).kinds(c)
  return [Slot(n, kind, prefix, index) for n, (kind, (prefix, index)) in enumerate(zip(kinds, layer_pattern.parameter_slots(kinds, c.scan_layers)))]


def _global_rules(c: MaxTextConfig) -> list[Rule]:
  rules = [
    Rule("embed/embedding", "model.embed_tokens.weight", _identity, _identity),
    Rule("final_norm/scale", "model.norm.weight", _identity, _identity),
  ]
  if not c.logits_via_embedding:
    rules.append(Rule("output/kernel", "lm_head.weight", _transpose, _transpose))
  if registry.get(c.decoder_block).gemma4_keys:
    rules += _gemma4_global_rules(c)
  return rules


# Families whose checkpoints keep their multi-token-prediction module under mtp.*: pre_fc_norm_embedding,
# pre_fc_norm_hidden, fc (the projection of [embedding; hidden]), mtp.layers.<k> (full-attention layers) and norm.
MTP_UNDER_MTP_PREFIX = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _mtp_prefix(c: MaxTextConfig, k: int) -> str:
  """Where MTP module k's tensors live: DeepSeek's layer num_hidden_layers + k, or Qwen's mtp.*."""
  return "mtp." if c.decoder_block in MTP_UNDER_MTP_PREFIX else f"model.layers.{c.num_decoder_layers + k}."


def _mtp_rules(c: MaxTextConfig) -> list[Rule]:
  """One multi-token-prediction module (DeepSeek's layer num_hidden_layers + k; Qwen's mtp.*): norms, projection, a layer
  built like the model's last attention layer."""
  layer = [dataclasses.replace(r, ours=f"layer/{r.ours}") for r in _layer_rules(c, mtp_layer_kind(c))]
  if c.decoder_block in MTP_UNDER_MTP_PREFIX:
    if c.mtp_num_layers > 1:
      raise ConfigError(
        f"{c.decoder_block} checkpoints share one MTP projection and norms across their MTP layers, maxtext's MTP modules each have their own; "
        "set mtp_num_layers=1 (or 0)"
      )
    return [
      Rule("embed_norm/scale", "pre_fc_norm_embedding.weight", _identity, _identity),
      Rule("hidden_norm/scale", "pre_fc_norm_hidden.weight", _identity, _identity),
      Rule("projection/kernel", "fc.weight", _transpose, _transpose),
      Rule("out_norm/scale", "norm.weight", _identity, _identity),
    ] + [dataclasses.replace(r, hf=f"layers.0.{r.hf}") for r in layer]
  rules = [
    Rule("embed_norm/scale", "enorm.weight", _identity, _identity),
    Rule("hidden_norm/scale", "hnorm.weight", _identity, _identity),
    Rule("projection/kernel", "eh_proj.weight", _transpose, _transpose),
    Rule("out_norm/scale", "shared_head.norm.weight", _identity, _identity),
  ]
  return rules + layer


def mtp_layer_kind(c: MaxTextConfig) -> LayerKind:
  """The kind of the MTP modules' layer: the model's last layer with attention (a Gated DeltaNet layer keeps a state)."""
  kinds = registry.get(c.decoder_block).kinds(c)
  return next((k for k in reversed(kinds) if k.mixer != "gated_deltanet"), kinds[-1])


# DeepSeek stores copies of the embedding and the output head in every MTP layer; maxtext shares the main model's.
MTP_SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


# Tensors of quantized checkpoints (FP8 block scales of DeepSeek's, bitsandbytes and GPTQ scales) that only a
# dequantizer consumes.
QUANTIZATION_SCALES = ("_scale_inv", ".weight_scale", ".scales", ".absmax", ".qzeros")


def _layer_index(name: str) -> int:
  """i of a tensor 'model.layers.<i>.*'; -1 for a tensor outside the layers."""
  parts = name.split(".")
  return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


# Multimodal Gemma 3 checkpoints keep the text decoder under one of these prefixes (hub layout, transformers 5 layout),
# beside the vision tower and projector that a text decoder leaves out.
TEXT_DECODER_PREFIXES = ("language_model.model.", "model.language_model.")
VISION_PREFIXES = (
  "vision_tower.",
  "multi_modal_projector.",
  "model.vision_tower.",
  "model.multi_modal_projector.",
  "vision_model.",
  "model.vision_model.",
  "model.visual.",
)
VISION_PREFIXES += ("model.audio_tower.", "model.embed_vision.", "model.embed_audio.")  # Gemma 4's audio tower and modality embedders


def text_decoder_tensors(tensors: dict[str, Array]) -> dict[str, Array]:
  """The tensors of a checkpoint's text decoder under the names of a causal LM (model.*, lm_head.weight): a multimodal
  Gemma 3 checkpoint's language model without its vision tower; other checkpoints unchanged."""
  if not any(k.startswith(TEXT_DECODER_PREFIXES) for k in tensors):
    return tensors
  out = {}
  for k, v in tensors.items():
    if k.startswith(VISION_PREFIXES):
      continue
    prefix = next((p for p in TEXT_DECODER_PREFIXES if k.startswith(p)), None)
    out["model." + k[len(prefix) :] if prefix else k.replace("language_model.lm_head.", "lm_head.")] = v
  return out


def check_weight(name: str, value: Array) -> None:
  """A float weight as the checkpoint stores it: a floating dtype (bfloat16 and float8 included) and only finite values
  (one float64 sum per tensor, which no finite float32 tensor overflows), else a one-line ConfigError naming it."""
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise ConfigError(
      f"tensor '{name}' has dtype {value.dtype}, not a floating type; maxtext reads it as a float weight: "
      "the checkpoint is damaged or quantized in a format maxtext does not read (re-export it in float32 or bfloat16)"
    )
  if not np.isfinite(value.sum(dtype=np.float64)) and not np.isfinite(value).all():
    bad = value.size - int(np.count_nonzero(np.isfinite(value)))
    raise ConfigError(f"tensor '{name}' holds {bad} NaN or infinite value(s) of {value.size}; the checkpoint is corrupt: re-download or re-export it")


def hf_to_maxtext(tensors: dict[str, Array], config: MaxTextConfig, stored_mtp_layers: int = 0) -> dict[str, Array]:
  """Flat HF tensors -> flat maxtext params. Every tensor must be consumed, every weight a finite float (else a one-line
  ConfigError). stored_mtp_layers: DeepSeek's num_nextn_predict_layers, the MTP layers past num_hidden_layers that
  may be left out (those past config.mtp_num_layers are); no other tensor may be."""
  c = config
  vision: dict[str, Array] = {}
  if c.use_multimodal:  # Gemma 3's tower and projector; without use_multimodal a multimodal checkpoint loads its text decoder
    vision, names = _vision_from_hf(tensors, c)
    tensors = {k: v for k, v in tensors.items() if k not in names}
  if c.decoder_block == "qwen3_moe":  # Qwen3-VL-MoE stores its experts fused (gpt-oss's fused gate_up_proj is its own layout)
    tensors = hf_qwen3_vl.split_experts(tensors)
  tensors = mxfp4.dense_experts(text_decoder_tensors(tensors))
  if registry.get(c.decoder_block).deepseek4_keys:  # DeepSeek's names and per-expert tensors -> transformers' module names
    tensors = hf_deepseek_v4.module_names(tensors)
  used: set[str] = set()

  def take(name: str) -> Array:
    if name not in tensors:
      raise ConfigError(f"checkpoint is missing tensor '{name}' that the {c.decoder_block} model needs; is this the right model directory?")
    if name not in used and not name.endswith(hf_deepseek_v4.INTEGER_TENSORS):
      check_weight(name, tensors[name])
    used.add(name)
    return tensors[name]

  def convert(rule: Rule, name: str) -> Array:
    value = take(name)
    try:
      ours = rule.to_ours(value)
      return np.ascontiguousarray(ours[..., rule.part[0] :: rule.part[1]]) if rule.part else ours
    except ValueError:  # a reshape that cannot hold: config.json's sizes disagree with the tensors
      raise ConfigError(
        f"tensor '{name}' has shape {tuple(value.shape)}, which does not fit hidden_size={c.emb_dim}, num_attention_heads={c.num_query_heads}, "
        f"num_key_value_heads={c.num_kv_heads}, head_dim={c.head_dim}; config.json disagrees with the safetensors files: fix one of them"
      ) from None

  out: dict[str, Array] = {r.ours: convert(r, r.hf) for r in _global_rules(c)}
  per_layer: dict[str, list[Array]] = {}  # stacked path -> its layers' values, in stack order
  deepseek4 = registry.get(c.decoder_block).deepseek4_keys
  if deepseek4:
    out.update(hf_deepseek_v4.global_from_hf(take, c.mhc_expansion_rate))
  for slot in _slots(c):
    prefix = f"model.layers.{slot.hf_index}."
    if deepseek4:
      for path, value in _deepseek4_layer_from_hf(c, slot, lambda name, p=prefix: take(p + name)).items():
        if slot.index is None:
          out[f"{slot.prefix}/{path}"] = value
        else:
          per_layer.setdefault(f"{slot.prefix}/{path}", []).append(value)
      continue
    for r in _layer_rules(c, slot.kind):
      if r.experts:
        value = np.stack([convert(r, prefix + r.hf.format(j=j)) for j in range(c.num_experts)])
      else:
        value = convert(r, prefix + r.hf)
      if slot.index is None:
        out[f"{slot.prefix}/{r.ours}"] = value
      else:
        per_layer.setdefault(f"{slot.prefix}/{r.ours}", []).append(value)
  try:
    out.update({k: np.stack(v) for k, v in per_layer.items()})
  except ValueError as e:
    raise ConfigError(f"layers' tensors differ in shape ({_first_line(e)}); the safetensors files disagree with config.json") from None
  for k in range(c.mtp_num_layers):
    prefix = _mtp_prefix(c, k)
    for r in _mtp_rules(c):
      if r.experts:
        out[f"mtp/{k}/{r.ours}"] = np.stack([convert(r, prefix + r.hf.format(j=j)) for j in range(c.num_experts)])
      else:
        out[f"mtp/{k}/{r.ours}"] = convert(r, prefix + r.hf)
    for copy, main in MTP_SHARED_COPIES.items():
      if prefix + copy in tensors and main in tensors:
        if not np.array_equal(take(prefix + copy), tensors[main]):
          raise ConfigError(f"'{prefix + copy}' differs from '{main}'; maxtext's MTP modules share the main model's embedding and output head")
  # DeepSeek's multi-token-prediction layers past num_hidden_layers (transformers does not run them) that
  # mtp_num_layers leaves out.
  used.update(k for k in tensors if c.num_decoder_layers + c.mtp_num_layers <= _layer_index(k) < c.num_decoder_layers + stored_mtp_layers)
  if deepseek4:  # V4's multi-token-prediction module (mtp.*; transformers does not load it either) is not built here
    used.update(k for k in tensors if k.startswith(("mtp.", "model.mtp.")))
  if c.decoder_block in MTP_UNDER_MTP_PREFIX and not c.mtp_num_layers:  # Qwen's MTP module (mtp.*), left out without mtp_num_layers
    used.update(k for k in tensors if k.startswith("mtp."))
  # Tied checkpoints may carry a copy of the embedding as lm_head.
  if c.logits_via_embedding and "lm_head.weight" in tensors and np.array_equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")):
    used.add("lm_head.weight")
  _check_all_used(sorted(set(tensors) - used), c, stored_mtp_layers)
  return out | vision


def _vision_from_hf(tensors: dict[str, Array], c: MaxTextConfig) -> tuple[dict[str, Array], set[str]]:
  """use_multimodal: the checkpoint's vision tower and projector as flat maxtext params, and the names consumed."""
  from maxtext.models import specs
  from maxtext.vision import llama4_convert

  if c.vision_encoder_block == "qwen3_vl":
    try:
      out, names = hf_qwen3_vl.vision_from_hf(tensors, specs.vision(c))
    except ValueError as e:
      raise ConfigError(f"use_multimodal=true: {e}; convert a Qwen3VLForConditionalGeneration checkpoint whose config.json matches it") from None
    for name in sorted(names):
      check_weight(name, tensors[name])
    return out, names
  llama4 = c.decoder_block == "llama4"
  read = llama4_convert.llama4_vision_from_hf if llama4 else vision_convert.gemma3_vision_from_hf
  try:
    out, names = read(tensors, specs.vision(c))
  except ValueError as e:
    kind = "Llama4ForConditionalGeneration" if llama4 else "Gemma3ForConditionalGeneration"
    raise ConfigError(f"use_multimodal=true: {e}; convert a {kind} checkpoint whose config.json matches it") from None
  for name in sorted(names):
    check_weight(name, tensors[name])
  return out, names


MULTIMODAL_TEXT_PREFIX = (
  "language_model."  # transformers 5's save_pretrained of Gemma3ForConditionalGeneration: language_model.model.*, language_model.lm_head.*
)


def _check_all_used(unused: list[str], c: MaxTextConfig, stored_mtp_layers: int) -> None:
  """A one-line ConfigError naming the checkpoint's tensors the conversion did not consume, with the likely cause."""
  if not unused:
    return
  last = max(_layer_index(k) for k in unused)
  if last >= c.num_decoder_layers + stored_mtp_layers:
    mtp = f" plus num_nextn_predict_layers={stored_mtp_layers} MTP layer(s)" if stored_mtp_layers else ""
    raise ConfigError(
      f"the safetensors hold tensors of layer {last} ('{next(k for k in unused if _layer_index(k) == last)}') but config.json's "
      f"num_hidden_layers is {c.num_decoder_layers}{mtp}: the layers past it would be dropped; fix num_hidden_layers (or remove the stray tensors)"
    )
  if any(k.endswith(QUANTIZATION_SCALES) for k in unused):
    raise ConfigError(
      f"the checkpoint is quantized ('{next(k for k in unused if k.endswith(QUANTIZATION_SCALES))}' is a scale tensor); "
      "maxtext reads float weights: dequantize it to bfloat16 first"
    )
  raise ConfigError(f"checkpoint has {len(unused)} tensor(s) the {c.decoder_block} model does not use: {shorten(unused)}; check the model type and config")


def _first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def maxtext_to_hf(params: dict[str, Array], config: MaxTextConfig) -> dict[str, Array]:
  """Flat maxtext params -> flat HF tensors. Every parameter must be assigned (else a one-line ConfigError)."""
  c = config
  used: set[str] = set()

  def take(path: str) -> Array:
    if path not in params:
      raise ConfigError(f"checkpoint is missing parameter '{path}'; was it written for this config?")
    used.add(path)
    return np.asarray(params[path])

  out = {r.hf: r.to_hf(take(r.ours)) for r in _global_rules(c)}
  parts: dict[str, dict[int, Array]] = {}  # HF name -> its interleaved column sets, joined once all are in
  deepseek4 = registry.get(c.decoder_block).deepseek4_keys
  if deepseek4:
    out.update(hf_deepseek_v4.global_to_hf(take))
  for slot in _slots(c):
    prefix = f"model.layers.{slot.hf_index}."
    if deepseek4:

      def get(path: str, slot: Slot = slot) -> Array:
        value = take(f"{slot.prefix}/{path}")
        return value if slot.index is None else value[slot.index]

      out.update({prefix + name: value for name, value in _deepseek4_layer_to_hf(c, slot, get).items()})
      continue
    for r in _layer_rules(c, slot.kind):
      value = take(f"{slot.prefix}/{r.ours}")
      value = value if slot.index is None else value[slot.index]
      if r.experts:
        for j in range(c.num_experts):
          out[prefix + r.hf.format(j=j)] = r.to_hf(value[j])
      elif r.part:
        parts.setdefault(prefix + r.hf, {})[r.part[0]] = value
        if len(parts[prefix + r.hf]) == r.part[1]:
          joined = np.stack([parts[prefix + r.hf][k] for k in range(r.part[1])], axis=-1).reshape(*value.shape[:-1], -1)
          out[prefix + r.hf] = r.to_hf(joined)
      else:
        out[prefix + r.hf] = r.to_hf(value)
  for k in range(c.mtp_num_layers):
    prefix = _mtp_prefix(c, k)
    for r in _mtp_rules(c):
      value = take(f"mtp/{k}/{r.ours}")
      if r.experts:
        out.update({prefix + r.hf.format(j=j): r.to_hf(value[j]) for j in range(c.num_experts)})
      else:
        out[prefix + r.hf] = r.to_hf(value)
    if c.decoder_block not in MTP_UNDER_MTP_PREFIX:
      out.update({prefix + copy: out[main] for copy, main in MTP_SHARED_COPIES.items() if main in out})
  if c.use_multimodal:
    from maxtext.models import specs

    vision = {k: v for k, v in params.items() if k.startswith("vision/")}
    used.update(vision)
    if c.vision_encoder_block == "qwen3_vl":
      out = hf_qwen3_vl.text_names_to_hf(out, fuse_experts=c.num_experts > 1) | hf_qwen3_vl.vision_to_hf(vision, specs.vision(c))
    else:
      from maxtext.vision import llama4_convert

      write = llama4_convert.llama4_vision_to_hf if c.decoder_block == "llama4" else vision_convert.gemma3_vision_to_hf
      out = {MULTIMODAL_TEXT_PREFIX + k: v for k, v in out.items()} | write(vision, specs.vision(c))
  unexpected = sorted(set(params) - used)
  if unexpected:
    raise ConfigError(f"parameters with no Hugging Face name: {shorten(unexpected)}; merge or drop adapters/connectors before exporting")
  return hf_deepseek_v4.checkpoint_names(out) if deepseek4 else out


def _deepseek4_layer_from_hf(c: MaxTextConfig, slot: Slot, get: Callable[[str], Array]) -> dict[str, Array]:
  """DeepSeek V4's layer at slot (get: its tensor by name under model.layers.<i>.) -> our parameters by path under it."""
  from maxtext.models import specs

  spec = specs.compressed_attention(c, slot.kind)
  try:
    return hf_deepseek_v4.layer_from_hf(get, spec, slot.kind.ffn == "moe_hash", c.mhc_expansion_rate, c.num_experts)
  except ValueError as e:  # a reshape that cannot hold: config.json's sizes disagree with the tensors
    raise ConfigError(f"layer {slot.hf_index}'s tensors do not fit config.json ({_first_line(e)}); the safetensors files disagree with it") from None


def _deepseek4_layer_to_hf(c: MaxTextConfig, slot: Slot, get: Callable[[str], Array]) -> dict[str, Array]:
  """Our parameters of DeepSeek V4's layer at slot (get: path under the layer) -> its tensors by name under model.layers.<i>."""
  from maxtext.models import specs

  return hf_deepseek_v4.layer_to_hf(get, specs.compressed_attention(c, slot.kind), slot.kind.ffn == "moe_hash")


def _gemma4_layer_rules(c: MaxTextConfig, kind: LayerKind) -> list:
  """The tensors of one Gemma 4 decoder layer of this kind (maxtext.convert.hf_params.Rule)."""
  full = kind.variant == "global"
  e, h = c.emb_dim, c.num_query_heads
  d = (c.global_head_dim or c.head_dim) if full else c.head_dim
  kv = (c.global_num_kv_heads or c.num_kv_heads) if full else c.num_kv_heads
  if c.v_norm_with_scale:
    raise ConfigError("Gemma4's value norm has no scale in Hugging Face checkpoints; set v_norm_with_scale=false")
  rules = [
    Rule("attention/query/kernel", "self_attn.q_proj.weight", *_linear((e,), (h, d))),
    Rule("attention/out/kernel", "self_attn.o_proj.weight", *_linear((h, d), (e,))),
    Rule("attention/query_norm/scale", "self_attn.q_norm.weight", _identity, _identity),
  ]
  if not kind.kv_shared:
    rules += [
      Rule("attention/key/kernel", "self_attn.k_proj.weight", *_linear((e,), (kv, d))),
      Rule("attention/key_norm/scale", "self_attn.k_norm.weight", _identity, _identity),
    ]
    if not (full and c.share_kv_projections):
      rules.append(Rule("attention/value/kernel", "self_attn.v_proj.weight", *_linear((e,), (kv, d))))
  for ours, hf in registry.get(c.decoder_block).hf_norm_names.items():
    rules.append(Rule(f"{ours}/scale", f"{hf}.weight", _identity, _identity))
  rules += _gemma4_moe_rules() if kind.ffn != "dense" else _dense_mlp_rules("mlp", "mlp")
  if c.hidden_size_per_layer_input:
    rules += [
      Rule("per_layer_input_gate/kernel", "per_layer_input_gate.weight", _transpose, _transpose),
      Rule("per_layer_projection/kernel", "per_layer_projection.weight", _transpose, _transpose),
      Rule("post_per_layer_input_norm/scale", "post_per_layer_input_norm.weight", _identity, _identity),
    ]
  rules.append(Rule("layer_scalar", "layer_scalar", _scalar_to_ours, _scalar_to_hf))
  return rules


def _experts_to_ours(x: Array) -> Array:
  """Stacked per-expert Linear weights [E, out, in] -> our [E, in, out]."""
  return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def _gemma4_moe_rules() -> list:
  """Gemma 4's MoE block: the dense MLP (our shared expert) with its post-norm, the router (its scale, per-expert
  scales), the experts' pre- and post-norms, and the stacked experts (gate then up halves in gate_up_proj [E, 2 x mlp, in])."""

  def gate_up_to_ours(x: Array) -> Array:
    return _halves_to_interleaved(_experts_to_ours(x))

  def gate_up_to_hf(x: Array) -> Array:
    return _experts_to_ours(_interleaved_to_halves(x))

  return [
    *_dense_mlp_rules("mlp/shared_experts", "mlp"),
    Rule("mlp/shared_post_norm/scale", "post_feedforward_layernorm_1.weight", _identity, _identity),
    Rule("mlp/gate/kernel", "router.proj.weight", _transpose, _transpose),
    Rule("mlp/router_norm/scale", "router.scale", _identity, _identity),
    Rule("mlp/per_expert_scale", "router.per_expert_scale", _identity, _identity),
    Rule("mlp/routed_pre_norm/scale", "pre_feedforward_layernorm_2.weight", _identity, _identity),
    Rule("mlp/wi_0", "experts.gate_up_proj", gate_up_to_ours, gate_up_to_hf, part=(0, 2)),
    Rule("mlp/wi_1", "experts.gate_up_proj", gate_up_to_ours, gate_up_to_hf, part=(1, 2)),
    Rule("mlp/wo", "experts.down_proj", _experts_to_ours, _experts_to_ours),
    Rule("mlp/routed_post_norm/scale", "post_feedforward_layernorm_2.weight", _identity, _identity),
  ]


def _gemma4_global_rules(c: MaxTextConfig) -> list:
  """The per-layer input embedding's tensors outside the layers (none without hidden_size_per_layer_input)."""
  if not c.hidden_size_per_layer_input:
    return []
  return [
    Rule("per_layer_inputs_embed/embedding", "model.embed_tokens_per_layer.weight", _identity, _identity),
    Rule("per_layer_model_projection/kernel", "model.per_layer_model_projection.weight", _transpose, _transpose),
    Rule("per_layer_projection_norm/scale", "model.per_layer_projection_norm.weight", _identity, _identity),
  ]


def _scalar_to_ours(x):
  return x.reshape(())


def _scalar_to_hf(x):
  return x.reshape(1)
