"""Hugging Face tensor names and layouts <-> maxtext parameter paths and layouts.

maxtext paths are '/'-joined nnx state paths. With scan_layers the layer parameters
are stacked under 'layers/<name>' with a leading layer axis; unscanned they live
under 'layers/<i>/<name>'. The conversions are exact (transposes and reshapes only,
maxtext.convert.hf_layouts), so HF -> maxtext -> HF round trips bit for bit; the rules per
layer are in maxtext.convert.hf_layer_rules.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from maxtext.config import MaxTextConfig
from maxtext.convert import hf_deepseek_v4, hf_qwen3_vl, mxfp4
from maxtext.convert.hf_checkpoint_tensors import MULTIMODAL_TEXT_PREFIX, check_all_used, check_weight, first_line, layer_index, text_decoder_tensors
from maxtext.convert.hf_layer_rules import MTP_SHARED_COPIES, MTP_UNDER_MTP_PREFIX, global_rules, layer_rules, mtp_prefix, mtp_rules
from maxtext.convert.hf_layer_slots import Slot, slots
from maxtext.convert.hf_layouts import (
  Array,
  Rule,
)
from maxtext.errors import ConfigError, shorten
from maxtext.models import registry
from maxtext.vision import convert as vision_convert


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

  out: dict[str, Array] = {r.ours: convert(r, r.hf) for r in global_rules(c)}
  per_layer: dict[str, list[Array]] = {}  # stacked path -> its layers' values, in stack order
  deepseek4 = registry.get(c.decoder_block).deepseek4_keys
  if deepseek4:
    out.update(hf_deepseek_v4.global_from_hf(take, c.mhc_expansion_rate))
  for slot in slots(c):
    prefix = f"model.layers.{slot.hf_index}."
    if deepseek4:
      for path, value in _deepseek4_layer_from_hf(c, slot, lambda name, p=prefix: take(p + name)).items():
        if slot.index is None:
          out[f"{slot.prefix}/{path}"] = value
        else:
          per_layer.setdefault(f"{slot.prefix}/{path}", []).append(value)
      continue
    for r in layer_rules(c, slot.kind):
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
    raise ConfigError(f"layers' tensors differ in shape ({first_line(e)}); the safetensors files disagree with config.json") from None
  for k in range(c.mtp_num_layers):
    prefix = mtp_prefix(c, k)
    for r in mtp_rules(c):
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
  used.update(k for k in tensors if c.num_decoder_layers + c.mtp_num_layers <= layer_index(k) < c.num_decoder_layers + stored_mtp_layers)
  if deepseek4:  # V4's multi-token-prediction module (mtp.*; transformers does not load it either) is not built here
    used.update(k for k in tensors if k.startswith(("mtp.", "model.mtp.")))
  if c.decoder_block in MTP_UNDER_MTP_PREFIX and not c.mtp_num_layers:  # Qwen's MTP module (mtp.*), left out without mtp_num_layers
    used.update(k for k in tensors if k.startswith("mtp."))
  # Tied checkpoints may carry a copy of the embedding as lm_head.
  if c.logits_via_embedding and "lm_head.weight" in tensors and np.array_equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")):
    used.add("lm_head.weight")
  check_all_used(sorted(set(tensors) - used), c, stored_mtp_layers)
  return out | vision


def _vision_from_hf(tensors: dict[str, Array], c: MaxTextConfig) -> tuple[dict[str, Array], set[str]]:
  """use_multimodal: the checkpoint's vision tower and projector as flat maxtext params, and the names consumed."""
  from maxtext.models import vision_specs
  from maxtext.vision import llama4_convert

  if c.vision_encoder_block == "qwen3_vl":
    try:
      out, names = hf_qwen3_vl.vision_from_hf(tensors, vision_specs.vision(c))
    except ValueError as e:
      raise ConfigError(f"use_multimodal=true: {e}; convert a Qwen3VLForConditionalGeneration checkpoint whose config.json matches it") from None
    for name in sorted(names):
      check_weight(name, tensors[name])
    return out, names
  llama4 = c.decoder_block == "llama4"
  read = llama4_convert.llama4_vision_from_hf if llama4 else vision_convert.gemma3_vision_from_hf
  try:
    out, names = read(tensors, vision_specs.vision(c))
  except ValueError as e:
    kind = "Llama4ForConditionalGeneration" if llama4 else "Gemma3ForConditionalGeneration"
    raise ConfigError(f"use_multimodal=true: {e}; convert a {kind} checkpoint whose config.json matches it") from None
  for name in sorted(names):
    check_weight(name, tensors[name])
  return out, names


def maxtext_to_hf(params: dict[str, Array], config: MaxTextConfig) -> dict[str, Array]:
  """Flat maxtext params -> flat HF tensors. Every parameter must be assigned (else a one-line ConfigError)."""
  c = config
  used: set[str] = set()

  def take(path: str) -> Array:
    if path not in params:
      raise ConfigError(f"checkpoint is missing parameter '{path}'; was it written for this config?")
    used.add(path)
    return np.asarray(params[path])

  out = {r.hf: r.to_hf(take(r.ours)) for r in global_rules(c)}
  parts: dict[str, dict[int, Array]] = {}  # HF name -> its interleaved column sets, joined once all are in
  deepseek4 = registry.get(c.decoder_block).deepseek4_keys
  if deepseek4:
    out.update(hf_deepseek_v4.global_to_hf(take))
  for slot in slots(c):
    prefix = f"model.layers.{slot.hf_index}."
    if deepseek4:

      def get(path: str, slot: Slot = slot) -> Array:
        value = take(f"{slot.prefix}/{path}")
        return value if slot.index is None else value[slot.index]

      out.update({prefix + name: value for name, value in _deepseek4_layer_to_hf(c, slot, get).items()})
      continue
    for r in layer_rules(c, slot.kind):
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
    prefix = mtp_prefix(c, k)
    for r in mtp_rules(c):
      value = take(f"mtp/{k}/{r.ours}")
      if r.experts:
        out.update({prefix + r.hf.format(j=j): r.to_hf(value[j]) for j in range(c.num_experts)})
      else:
        out[prefix + r.hf] = r.to_hf(value)
    if c.decoder_block not in MTP_UNDER_MTP_PREFIX:
      out.update({prefix + copy: out[main] for copy, main in MTP_SHARED_COPIES.items() if main in out})
  if c.use_multimodal:
    from maxtext.models import vision_specs

    vision = {k: v for k, v in params.items() if k.startswith("vision/")}
    used.update(vision)
    if c.vision_encoder_block == "qwen3_vl":
      out = hf_qwen3_vl.text_names_to_hf(out, fuse_experts=c.num_experts > 1) | hf_qwen3_vl.vision_to_hf(vision, vision_specs.vision(c))
    else:
      from maxtext.vision import llama4_convert

      write = llama4_convert.llama4_vision_to_hf if c.decoder_block == "llama4" else vision_convert.gemma3_vision_to_hf
      out = {MULTIMODAL_TEXT_PREFIX + k: v for k, v in out.items()} | write(vision, vision_specs.vision(c))
  unexpected = sorted(set(params) - used)
  if unexpected:
    raise ConfigError(f"parameters with no Hugging Face name: {shorten(unexpected)}; merge or drop adapters/connectors before exporting")
  return hf_deepseek_v4.checkpoint_names(out) if deepseek4 else out


def _deepseek4_layer_from_hf(c: MaxTextConfig, slot: Slot, get: Callable[[str], Array]) -> dict[str, Array]:
  """DeepSeek V4's layer at slot (get: its tensor by name under model.layers.<i>.) -> our parameters by path under it."""
  from maxtext.models import mixer_specs

  spec = mixer_specs.compressed_attention(c, slot.kind)
  try:
    return hf_deepseek_v4.layer_from_hf(get, spec, slot.kind.ffn == "moe_hash", c.mhc_expansion_rate, c.num_experts)
  except ValueError as e:  # a reshape that cannot hold: config.json's sizes disagree with the tensors
    raise ConfigError(f"layer {slot.hf_index}'s tensors do not fit config.json ({first_line(e)}); the safetensors files disagree with it") from None


def _deepseek4_layer_to_hf(c: MaxTextConfig, slot: Slot, get: Callable[[str], Array]) -> dict[str, Array]:
  """Our parameters of DeepSeek V4's layer at slot (get: path under the layer) -> its tensors by name under model.layers.<i>."""
  from maxtext.models import mixer_specs

  return hf_deepseek_v4.layer_to_hf(get, mixer_specs.compressed_attention(c, slot.kind), slot.kind.ffn == "moe_hash")
