"""The tensor rules of each family's decoder layers (attention, Gated DeltaNet, MLA and its indexer, dense and MoE MLPs,
Gemma 4's layers), of the tensors outside the layers, and of the multi-token-prediction modules."""

from __future__ import annotations

import dataclasses

from maxtext.config import MaxTextConfig
from maxtext.convert.hf_layouts import (
  Array,
  Rule,
  bias,
  conv_to_hf,
  conv_to_ours,
  experts_to_ours,
  halves_to_interleaved,
  identity,
  interleaved_to_halves,
  linear,
  scalar_to_hf,
  scalar_to_ours,
  transpose,
)
from maxtext.errors import ConfigError
from maxtext.models import registry
from maxtext.models.family import LayerKind


def _gated_deltanet_rules(c: MaxTextConfig) -> list[Rule]:
  """Qwen3NextGatedDeltaNet (linear_attn.*): the fused projections keep HF's per-key-head order; Qwen3_5GatedDeltaNet's
  split ones are plain linear layers; conv1d [C, 1, K] is our [K, C]."""
  e, hk, dk, hv, dv = c.emb_dim, c.gdn_num_key_heads, c.gdn_key_head_dim, c.gdn_num_value_heads, c.gdn_value_head_dim
  r = hv // hk
  if registry.get(c.decoder_block).split_linear_projections:  # Qwen3_5GatedDeltaNet
    projections = [
      Rule("attention/in_proj_qkv/kernel", "linear_attn.in_proj_qkv.weight", transpose, transpose),
      Rule("attention/in_proj_z/kernel", "linear_attn.in_proj_z.weight", *linear((e,), (hv, dv))),
      Rule("attention/in_proj_b/kernel", "linear_attn.in_proj_b.weight", transpose, transpose),
      Rule("attention/in_proj_a/kernel", "linear_attn.in_proj_a.weight", transpose, transpose),
    ]
  else:
    projections = [
      Rule("attention/in_proj_qkvz/kernel", "linear_attn.in_proj_qkvz.weight", *linear((e,), (hk, 2 * dk + 2 * r * dv))),
      Rule("attention/in_proj_ba/kernel", "linear_attn.in_proj_ba.weight", *linear((e,), (hk, 2 * r))),
    ]
  return projections + [
    Rule("attention/conv", "linear_attn.conv1d.weight", conv_to_ours, conv_to_hf),
    Rule("attention/A_log", "linear_attn.A_log", identity, identity),
    Rule("attention/dt_bias", "linear_attn.dt_bias", identity, identity),
    Rule("attention/norm/scale", "linear_attn.norm.weight", identity, identity),
    Rule("attention/out_proj/kernel", "linear_attn.out_proj.weight", *linear((hv, dv), (e,))),
  ]


def _indexer_rules(c: MaxTextConfig) -> list[Rule]:
  """DeepSeek Sparse Attention's lightning indexer (DeepseekV32's self_attn.indexer)."""
  e, h, d = c.emb_dim, c.indexer_n_heads, c.indexer_head_dim
  return [
    Rule("attention/indexer/wq_b/kernel", "self_attn.indexer.wq_b.weight", *linear((c.q_lora_rank,), (h, d))),
    Rule("attention/indexer/wk/kernel", "self_attn.indexer.wk.weight", *linear((e,), (d,))),
    Rule("attention/indexer/k_norm/scale", "self_attn.indexer.k_norm.weight", identity, identity),
    Rule("attention/indexer/k_norm/bias", "self_attn.indexer.k_norm.bias", identity, identity),
    Rule("attention/indexer/weights_proj/kernel", "self_attn.indexer.weights_proj.weight", *linear((e,), (h,))),
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
      rules.append(Rule("attention/wq/kernel", "self_attn.q_proj.weight", *linear((e,), (h, qk))))
    else:
      rules += [
        Rule("attention/wq_a/kernel", "self_attn.q_a_proj.weight", *linear((e,), (c.q_lora_rank,))),
        Rule("attention/q_norm/scale", "self_attn.q_a_layernorm.weight", identity, identity),
        Rule("attention/wq_b/kernel", "self_attn.q_b_proj.weight", *linear((c.q_lora_rank,), (h, qk))),
      ]
    return rules + [
      Rule("attention/wkv_a/kernel", "self_attn.kv_a_proj_with_mqa.weight", *linear((e,), (c.kv_lora_rank + c.qk_rope_head_dim,))),
      Rule("attention/kv_norm/scale", "self_attn.kv_a_layernorm.weight", identity, identity),
      Rule("attention/wkv_b/kernel", "self_attn.kv_b_proj.weight", *linear((c.kv_lora_rank,), (h, c.qk_nope_head_dim + c.v_head_dim))),
      Rule("attention/out/kernel", "self_attn.o_proj.weight", *linear((h, c.v_head_dim), (e,))),
    ]
  rules = [
    Rule("attention/query/kernel", "self_attn.q_proj.weight", *linear((e,), (h, 2 * d if registry.get(c.decoder_block).attention_output_gate else d))),
    Rule("attention/key/kernel", "self_attn.k_proj.weight", *linear((e,), (kv, d))),
    Rule("attention/value/kernel", "self_attn.v_proj.weight", *linear((e,), (kv, d))),
    Rule("attention/out/kernel", "self_attn.o_proj.weight", *linear((h, d), (e,))),
  ]
  if c.attention_bias:
    rules += [
      Rule("attention/query/bias", "self_attn.q_proj.bias", *bias((h, d))),
      Rule("attention/key/bias", "self_attn.k_proj.bias", *bias((kv, d))),
      Rule("attention/value/bias", "self_attn.v_proj.bias", *bias((kv, d))),
    ]
    if registry.get(c.decoder_block).attention_out_bias:
      rules.append(Rule("attention/out/bias", "self_attn.o_proj.bias", identity, identity))
  if c.attention_sink:
    rules.append(Rule("attention/sinks", "self_attn.sinks", identity, identity))
  if c.use_qk_norm and not registry.get(c.decoder_block).l2_qk_norm:  # Llama 4's L2 norm has no weights
    rules += [Rule("attention/query_norm/scale", "self_attn.q_norm.weight", identity, identity)]
    rules += [Rule("attention/key_norm/scale", "self_attn.k_norm.weight", identity, identity)]
  return rules


def _gpt_oss_moe_rules() -> list[Rule]:
  """gpt-oss experts: stacked tensors, gate and up interleaved column by column in gate_up_proj [E, in, 2 x mlp]."""
  return [
    Rule("mlp/gate/kernel", "mlp.router.weight", transpose, transpose),
    Rule("mlp/gate/bias", "mlp.router.bias", identity, identity),
    Rule("mlp/wi_0", "mlp.experts.gate_up_proj", identity, identity, part=(0, 2)),
    Rule("mlp/wi_1", "mlp.experts.gate_up_proj", identity, identity, part=(1, 2)),
    Rule("mlp/wi_0_bias", "mlp.experts.gate_up_proj_bias", identity, identity, part=(0, 2)),
    Rule("mlp/wi_1_bias", "mlp.experts.gate_up_proj_bias", identity, identity, part=(1, 2)),
    Rule("mlp/wo", "mlp.experts.down_proj", identity, identity),
    Rule("mlp/wo_bias", "mlp.experts.down_proj_bias", identity, identity),
  ]


def _llama4_moe_rules() -> list[Rule]:
  """Llama 4 experts: stacked tensors, gate then up halves in gate_up_proj [E, in, 2 x mlp]; a router and a shared expert."""
  return [
    Rule("mlp/gate/kernel", "feed_forward.router.weight", transpose, transpose),
    Rule("mlp/wi_0", "feed_forward.experts.gate_up_proj", halves_to_interleaved, interleaved_to_halves, part=(0, 2)),
    Rule("mlp/wi_1", "feed_forward.experts.gate_up_proj", halves_to_interleaved, interleaved_to_halves, part=(1, 2)),
    Rule("mlp/wo", "feed_forward.experts.down_proj", identity, identity),
    *_dense_mlp_rules("mlp/shared_experts", "feed_forward.shared_expert"),
  ]


def _dense_mlp_rules(ours: str, hf: str) -> list[Rule]:
  return [
    Rule(f"{ours}/wi_0/kernel", f"{hf}.gate_proj.weight", transpose, transpose),
    Rule(f"{ours}/wi_1/kernel", f"{hf}.up_proj.weight", transpose, transpose),
    Rule(f"{ours}/wo/kernel", f"{hf}.down_proj.weight", transpose, transpose),
  ]


def layer_rules(c: MaxTextConfig, kind: LayerKind) -> list[Rule]:
  """Rules of one decoder layer of this kind."""
  if len(c.mlp_activations) != 2:
    raise ConfigError("a single MLP activation has no Hugging Face layout; use mlp_activations=[<act>, linear]")
  if registry.get(c.decoder_block).gemma4_keys:
    return _gemma4_layer_rules(c, kind)
  rules = _attention_rules(c, kind.mixer)
  dense = kind.ffn == "dense"
  for ours, hf in registry.get(c.decoder_block).hf_norm_names.items():
    rules.append(Rule(f"{ours}/scale", f"{hf}.weight", identity, identity))
  if c.num_experts == 1 or dense:
    return rules + _dense_mlp_rules("mlp", "feed_forward" if c.decoder_block == "llama4" else "mlp")
  if c.decoder_block == "llama4":
    return rules + _llama4_moe_rules()
  if c.decoder_block == "gpt_oss":
    return rules + _gpt_oss_moe_rules()
  if c.decoder_block == "mixtral":
    return rules + [
      Rule("mlp/gate/kernel", "block_sparse_moe.gate.weight", transpose, transpose),
      Rule("mlp/wi_0", "block_sparse_moe.experts.{j}.w1.weight", transpose, transpose, experts=True),
      Rule("mlp/wi_1", "block_sparse_moe.experts.{j}.w3.weight", transpose, transpose, experts=True),
      Rule("mlp/wo", "block_sparse_moe.experts.{j}.w2.weight", transpose, transpose, experts=True),
    ]
  rules += [
    Rule("mlp/gate/kernel", "mlp.gate.weight", transpose, transpose),
    Rule("mlp/wi_0", "mlp.experts.{j}.gate_proj.weight", transpose, transpose, experts=True),
    Rule("mlp/wi_1", "mlp.experts.{j}.up_proj.weight", transpose, transpose, experts=True),
    Rule("mlp/wo", "mlp.experts.{j}.down_proj.weight", transpose, transpose, experts=True),
  ]
  if c.routed_bias:
    rules.append(Rule("mlp/routed_bias", "mlp.gate.e_score_correction_bias", identity, identity))
  if c.shared_experts:
    hf_shared = "mlp.shared_expert" if registry.get(c.decoder_block).shared_expert_gate else "mlp.shared_experts"
    rules += _dense_mlp_rules("mlp/shared_experts", hf_shared)
    if registry.get(c.decoder_block).shared_expert_gate:
      rules.append(Rule("mlp/shared_expert_gate/kernel", "mlp.shared_expert_gate.weight", transpose, transpose))
  return rules


def global_rules(c: MaxTextConfig) -> list[Rule]:
  rules = [
    Rule("embed/embedding", "model.embed_tokens.weight", identity, identity),
    Rule("final_norm/scale", "model.norm.weight", identity, identity),
  ]
  if not c.logits_via_embedding:
    rules.append(Rule("output/kernel", "lm_head.weight", transpose, transpose))
  if registry.get(c.decoder_block).gemma4_keys:
    rules += _gemma4_global_rules(c)
  return rules


# Families whose checkpoints keep their multi-token-prediction module under mtp.*: pre_fc_norm_embedding,
# pre_fc_norm_hidden, fc (the projection of [embedding; hidden]), mtp.layers.<k> (full-attention layers) and norm.
MTP_UNDER_MTP_PREFIX = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def mtp_prefix(c: MaxTextConfig, k: int) -> str:
  """Where MTP module k's tensors live: DeepSeek's layer num_hidden_layers + k, or Qwen's mtp.*."""
  return "mtp." if c.decoder_block in MTP_UNDER_MTP_PREFIX else f"model.layers.{c.num_decoder_layers + k}."


def mtp_rules(c: MaxTextConfig) -> list[Rule]:
  """One multi-token-prediction module (DeepSeek's layer num_hidden_layers + k; Qwen's mtp.*): norms, projection, a layer
  built like the model's last attention layer."""
  layer = [dataclasses.replace(r, ours=f"layer/{r.ours}") for r in layer_rules(c, mtp_layer_kind(c))]
  if c.decoder_block in MTP_UNDER_MTP_PREFIX:
    if c.mtp_num_layers > 1:
      raise ConfigError(
        f"{c.decoder_block} checkpoints share one MTP projection and norms across their MTP layers, maxtext's MTP modules each have their own; "
        "set mtp_num_layers=1 (or 0)"
      )
    return [
      Rule("embed_norm/scale", "pre_fc_norm_embedding.weight", identity, identity),
      Rule("hidden_norm/scale", "pre_fc_norm_hidden.weight", identity, identity),
      Rule("projection/kernel", "fc.weight", transpose, transpose),
      Rule("out_norm/scale", "norm.weight", identity, identity),
    ] + [dataclasses.replace(r, hf=f"layers.0.{r.hf}") for r in layer]
  rules = [
    Rule("embed_norm/scale", "enorm.weight", identity, identity),
    Rule("hidden_norm/scale", "hnorm.weight", identity, identity),
    Rule("projection/kernel", "eh_proj.weight", transpose, transpose),
    Rule("out_norm/scale", "shared_head.norm.weight", identity, identity),
  ]
  return rules + layer


def mtp_layer_kind(c: MaxTextConfig) -> LayerKind:
  """The kind of the MTP modules' layer: the model's last layer with attention (a Gated DeltaNet layer keeps a state)."""
  kinds = registry.get(c.decoder_block).kinds(c)
  return next((k for k in reversed(kinds) if k.mixer != "gated_deltanet"), kinds[-1])


# DeepSeek stores copies of the embedding and the output head in every MTP layer; maxtext shares the main model's.
MTP_SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def _gemma4_layer_rules(c: MaxTextConfig, kind: LayerKind) -> list:
  """The tensors of one Gemma 4 decoder layer of this kind (maxtext.convert.hf_layouts.Rule)."""
  full = kind.variant == "global"
  e, h = c.emb_dim, c.num_query_heads
  d = (c.global_head_dim or c.head_dim) if full else c.head_dim
  kv = (c.global_num_kv_heads or c.num_kv_heads) if full else c.num_kv_heads
  if c.v_norm_with_scale:
    raise ConfigError("Gemma4's value norm has no scale in Hugging Face checkpoints; set v_norm_with_scale=false")
  rules = [
    Rule("attention/query/kernel", "self_attn.q_proj.weight", *linear((e,), (h, d))),
    Rule("attention/out/kernel", "self_attn.o_proj.weight", *linear((h, d), (e,))),
    Rule("attention/query_norm/scale", "self_attn.q_norm.weight", identity, identity),
  ]
  if not kind.kv_shared:
    rules += [
      Rule("attention/key/kernel", "self_attn.k_proj.weight", *linear((e,), (kv, d))),
      Rule("attention/key_norm/scale", "self_attn.k_norm.weight", identity, identity),
    ]
    if not (full and c.share_kv_projections):
      rules.append(Rule("attention/value/kernel", "self_attn.v_proj.weight", *linear((e,), (kv, d))))
  for ours, hf in registry.get(c.decoder_block).hf_norm_names.items():
    rules.append(Rule(f"{ours}/scale", f"{hf}.weight", identity, identity))
  rules += _gemma4_moe_rules() if kind.ffn != "dense" else _dense_mlp_rules("mlp", "mlp")
  if c.hidden_size_per_layer_input:
    rules += [
      Rule("per_layer_input_gate/kernel", "per_layer_input_gate.weight", transpose, transpose),
      Rule("per_layer_projection/kernel", "per_layer_projection.weight", transpose, transpose),
      Rule("post_per_layer_input_norm/scale", "post_per_layer_input_norm.weight", identity, identity),
    ]
  rules.append(Rule("layer_scalar", "layer_scalar", scalar_to_ours, scalar_to_hf))
  return rules


def _gemma4_moe_rules() -> list:
  """Gemma 4's MoE block: the dense MLP (our shared expert) with its post-norm, the router (its scale, per-expert
  scales), the experts' pre- and post-norms, and the stacked experts (gate then up halves in gate_up_proj [E, 2 x mlp, in])."""

  def gate_up_to_ours(x: Array) -> Array:
    return halves_to_interleaved(experts_to_ours(x))

  def gate_up_to_hf(x: Array) -> Array:
    return experts_to_ours(interleaved_to_halves(x))

  return [
    *_dense_mlp_rules("mlp/shared_experts", "mlp"),
    Rule("mlp/shared_post_norm/scale", "post_feedforward_layernorm_1.weight", identity, identity),
    Rule("mlp/gate/kernel", "router.proj.weight", transpose, transpose),
    Rule("mlp/router_norm/scale", "router.scale", identity, identity),
    Rule("mlp/per_expert_scale", "router.per_expert_scale", identity, identity),
    Rule("mlp/routed_pre_norm/scale", "pre_feedforward_layernorm_2.weight", identity, identity),
    Rule("mlp/wi_0", "experts.gate_up_proj", gate_up_to_ours, gate_up_to_hf, part=(0, 2)),
    Rule("mlp/wi_1", "experts.gate_up_proj", gate_up_to_ours, gate_up_to_hf, part=(1, 2)),
    Rule("mlp/wo", "experts.down_proj", experts_to_ours, experts_to_ours),
    Rule("mlp/routed_post_norm/scale", "post_feedforward_layernorm_2.weight", identity, identity),
  ]


def _gemma4_global_rules(c: MaxTextConfig) -> list:
  """The per-layer input embedding's tensors outside the layers (none without hidden_size_per_layer_input)."""
  if not c.hidden_size_per_layer_input:
    return []
  return [
    Rule("per_layer_inputs_embed/embedding", "model.embed_tokens_per_layer.weight", identity, identity),
    Rule("per_layer_model_projection/kernel", "model.per_layer_model_projection.weight", transpose, transpose),
    Rule("per_layer_projection_norm/scale", "model.per_layer_projection_norm.weight", identity, identity),
  ]
