"""Hugging Face tensor names and layouts <-> maxtext parameter paths and layouts.

maxtext paths are '/'-joined nnx state paths. With scan_layers the layer parameters
are stacked under 'layers/<name>' with a leading layer axis; unscanned they live
under 'layers/<i>/<name>'. The conversions below are exact (transposes and
reshapes only), so HF -> maxtext -> HF round trips bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError, shorten
from maxtext.models import registry

Array = np.ndarray


@dataclasses.dataclass(frozen=True)
class Rule:
  ours: str  # path under a layer (or global)
  hf: str  # HF name; '{j}' for an expert index
  to_ours: Callable[[Array], Array]
  to_hf: Callable[[Array], Array]
  experts: bool = False  # ours is stacked over experts [n, ...]; hf has one tensor per expert


def _identity(x: Array) -> Array:
  return x


def _transpose(x: Array) -> Array:
  return np.ascontiguousarray(x.T)


def _layer_rules(c: MaxTextConfig) -> list[Rule]:
  e, h, kv, d = c.emb_dim, c.num_query_heads, c.num_kv_heads, c.head_dim

  def proj(heads: int) -> tuple[Callable, Callable]:
    return (lambda w: np.ascontiguousarray(w.T).reshape(e, heads, d), lambda w: np.ascontiguousarray(w.reshape(e, heads * d).T))

  q_in, q_out = proj(h)
  kv_in, kv_out = proj(kv)
  rules = [
    Rule("attention/query/kernel", "self_attn.q_proj.weight", q_in, q_out),
    Rule("attention/key/kernel", "self_attn.k_proj.weight", kv_in, kv_out),
    Rule("attention/value/kernel", "self_attn.v_proj.weight", kv_in, kv_out),
    Rule(
      "attention/out/kernel",
      "self_attn.o_proj.weight",
      lambda w: np.ascontiguousarray(w.T).reshape(h, d, e),
      lambda w: np.ascontiguousarray(w.reshape(h * d, e).T),
    ),
  ]
  if c.use_qk_norm:
    rules += [Rule("attention/query_norm/scale", "self_attn.q_norm.weight", _identity, _identity)]
    rules += [Rule("attention/key_norm/scale", "self_attn.k_norm.weight", _identity, _identity)]
  for ours, hf in registry.get(c.decoder_block).hf_norm_names.items():
    rules.append(Rule(f"{ours}/scale", f"{hf}.weight", _identity, _identity))
  if c.num_experts > 1:
    rules += [
      Rule("mlp/gate/kernel", "block_sparse_moe.gate.weight", _transpose, _transpose),
      Rule("mlp/wi_0", "block_sparse_moe.experts.{j}.w1.weight", _transpose, _transpose, experts=True),
      Rule("mlp/wi_1", "block_sparse_moe.experts.{j}.w3.weight", _transpose, _transpose, experts=True),
      Rule("mlp/wo", "block_sparse_moe.experts.{j}.w2.weight", _transpose, _transpose, experts=True),
    ]
  elif len(c.mlp_activations) == 2:
    rules += [
      Rule("mlp/wi_0/kernel", "mlp.gate_proj.weight", _transpose, _transpose),
      Rule("mlp/wi_1/kernel", "mlp.up_proj.weight", _transpose, _transpose),
      Rule("mlp/wo/kernel", "mlp.down_proj.weight", _transpose, _transpose),
    ]
  else:
    raise ConfigError("a single MLP activation has no Hugging Face layout; use mlp_activations=[<act>, linear]")
  return rules


def _global_rules(c: MaxTextConfig) -> list[Rule]:
  rules = [
    Rule("embed/embedding", "model.embed_tokens.weight", _identity, _identity),
    Rule("final_norm/scale", "model.norm.weight", _identity, _identity),
  ]
  if not c.logits_via_embedding:
    rules.append(Rule("output/kernel", "lm_head.weight", _transpose, _transpose))
  return rules


def hf_to_maxtext(tensors: dict[str, Array], config: MaxTextConfig) -> dict[str, Array]:
  """Flat HF tensors -> flat maxtext params. Every tensor must be consumed (else a one-line ConfigError)."""
  c = config
  used: set[str] = set()

  def take(name: str) -> Array:
    if name not in tensors:
      raise ConfigError(f"checkpoint is missing tensor '{name}' that the {c.decoder_block} model needs; is this the right model directory?")
    used.add(name)
    return tensors[name]

  def convert(rule: Rule, name: str) -> Array:
    value = take(name)
    try:
      return rule.to_ours(value)
    except ValueError:  # a reshape that cannot hold: config.json's sizes disagree with the tensors
      raise ConfigError(
        f"tensor '{name}' has shape {tuple(value.shape)}, which does not fit hidden_size={c.emb_dim}, num_attention_heads={c.num_query_heads}, "
        f"num_key_value_heads={c.num_kv_heads}, head_dim={c.head_dim}; config.json disagrees with the safetensors files: fix one of them"
      ) from None

  out: dict[str, Array] = {r.ours: convert(r, r.hf) for r in _global_rules(c)}
  per_layer: dict[str, list[Array]] = {}
  for i in range(c.num_decoder_layers):
    for r in _layer_rules(c):
      if r.experts:
        value = np.stack([convert(r, f"model.layers.{i}." + r.hf.format(j=j)) for j in range(c.num_experts)])
      else:
        value = convert(r, f"model.layers.{i}.{r.hf}")
      if c.scan_layers:
        per_layer.setdefault(r.ours, []).append(value)
      else:
        out[f"layers/{i}/{r.ours}"] = value
  try:
    out.update({f"layers/{k}": np.stack(v) for k, v in per_layer.items()})
  except ValueError as e:
    raise ConfigError(f"layers' tensors differ in shape ({_first_line(e)}); the safetensors files disagree with config.json") from None
  # Tied checkpoints may carry a copy of the embedding as lm_head.
  if c.logits_via_embedding and "lm_head.weight" in tensors and np.array_equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")):
    used.add("lm_head.weight")
  unused = sorted(set(tensors) - used)
  if unused:
    raise ConfigError(f"checkpoint has {len(unused)} tensor(s) the {c.decoder_block} model does not use: {shorten(unused)}; check the model type and config")
  return out


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
  for r in _layer_rules(c):
    stacked = take(f"layers/{r.ours}") if c.scan_layers else None
    for i in range(c.num_decoder_layers):
      value = stacked[i] if stacked is not None else take(f"layers/{i}/{r.ours}")
      if r.experts:
        for j in range(c.num_experts):
          out[f"model.layers.{i}." + r.hf.format(j=j)] = r.to_hf(value[j])
      else:
        out[f"model.layers.{i}.{r.hf}"] = r.to_hf(value)
  unexpected = sorted(set(params) - used)
  if unexpected:
    raise ConfigError(f"parameters with no Hugging Face name: {shorten(unexpected)}; merge or drop adapters/connectors before exporting")
  return out
