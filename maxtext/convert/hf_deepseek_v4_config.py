"""DeepSeek V4 config.json <-> maxtext keys (maxtext.convert.hf_config and hf_config_export call these for the deepseek4 family; its tensors
are in maxtext.convert.hf_deepseek_v4).

config.json names each layer's attention (layer_types: sliding_attention, compressed_sparse_attention,
heavily_compressed_attention, with one compress rate per compressed type in compress_rates) and each layer's router
(mlp_layer_types: hash_moe, then moe); maxtext keeps MaxText's per-layer compress_ratios with the rate that marks the
compressed sparse layers (csa_compress_ratio) and first_num_hash_layers. The older form (compress_ratios,
num_hash_layers, qk_rope_head_dim, rope_scaling) that DeepSeek's own config.json uses reads too.
"""

from __future__ import annotations

from typing import Any

from maxtext.convert.hf_fields import HFFields
from maxtext.errors import ConfigError

Config = Any  # a maxtext.config.MaxTextConfig, read by attribute (the config's loader imports this module)

MODEL_TYPE = "deepseek_v4"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
LEGACY_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # the per-layer compress_ratios of DeepSeek's config.json
ROUTERS = ("sqrtsoftplus", "sigmoid", "softmax")
DEFAULTS = {  # DeepseekV4Config's defaults for the fields a config.json may leave out
  "vocab_size": 129_280,
  "hidden_size": 4096,
  "moe_intermediate_size": 2048,
  "num_hidden_layers": 43,
  "num_attention_heads": 64,
  "head_dim": 512,
  "q_lora_rank": 1024,
  "num_experts_per_tok": 6,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "scoring_func": "sqrtsoftplus",
  "norm_topk_prob": True,
  "routed_scaling_factor": 1.5,
  "rope_theta": 10_000.0,
  "compress_rope_theta": 160_000.0,
  "hc_mult": 4,
  "hc_sinkhorn_iters": 20,
  "hc_eps": 1e-6,
  "swiglu_limit": 10.0,
  "sliding_window": 128,
  "o_groups": 8,
  "o_lora_rank": 1024,
  "index_n_heads": 64,
  "index_head_dim": 128,
  "index_topk": 512,
  "hidden_act": "silu",
  "rms_norm_eps": 1e-6,
  "tie_word_embeddings": False,
}


def _compress_rates(f: HFFields) -> dict[str, int]:
  rates = {CSA: 4, HCA: 128}
  section = f.values.get("compress_rates") or {}
  if not isinstance(section, dict):
    raise ConfigError(f"{f.name('compress_rates')} is not an object of layer type -> compress rate; fix the file")
  for key in section:
    if key not in (CSA, HCA):
      raise ConfigError(f"{f.name('compress_rates')} names unknown layer type '{key}'; DeepSeek V4 compresses {CSA} and {HCA}")
    rates[key] = f.section("compress_rates").int(key)
  for key in ("compress_rate_csa", "compress_rate_hca"):  # older top-level forms
    if f.has(key):
      rates[CSA if key.endswith("csa") else HCA] = f.int(key)
  if rates[CSA] == rates[HCA]:
    raise ConfigError(f"{f.source} gives both compressed layer types the compress rate {rates[CSA]}; maxtext tells them apart by rate: fix compress_rates")
  return rates


def _layer_rates(f: HFFields, layers: int) -> tuple[list[int], int]:
  """(each layer's compress rate, the compressed sparse layers' rate) from layer_types or the older compress_ratios."""
  rates = _compress_rates(f)
  types = f.texts("layer_types")
  if types is None and f.has("compress_ratios"):
    ratios = f.values["compress_ratios"]
    unknown = sorted({r for r in ratios if r not in LEGACY_RATIO_TYPES}, key=str)
    if unknown:
      raise ConfigError(f"{f.name('compress_ratios')} has rate(s) {unknown} of no DeepSeek V4 layer type; use 0 (sliding), 4 (CSA) or 128 (HCA)")
    types = [LEGACY_RATIO_TYPES[r] for r in ratios]
    rates = {CSA: 4, HCA: 128}
  if types is None:  # DeepseekV4Config's default: two HCA layers, then CSA and HCA alternating
    types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
  unknown = sorted(set(types) - set(LAYER_TYPES))
  if unknown:
    raise ConfigError(f"{f.name('layer_types')} has unknown layer type(s) {', '.join(unknown)}; DeepSeek V4 has {', '.join(LAYER_TYPES)}")
  if len(types) < layers:
    raise ConfigError(f"{f.name('layer_types')} has {len(types)} entries for num_hidden_layers={layers}; give one per layer")
  return [0 if t == SLIDING else rates[t] for t in types[:layers]], rates[CSA]


def _hash_layers(f: HFFields, layers: int) -> int:
  types = f.texts("mlp_layer_types")
  if types is None:
    return min(layers, f.int("num_hash_layers", 3, minimum=0))
  unknown = sorted(set(types) - set(MLP_LAYER_TYPES))
  if unknown:
    raise ConfigError(f"{f.name('mlp_layer_types')} has unknown router type(s) {', '.join(unknown)}; DeepSeek V4 has {', '.join(MLP_LAYER_TYPES)}")
  types = types[:layers]
  hashed = next((i for i, t in enumerate(types) if t != "hash_moe"), len(types))
  if "hash_moe" in types[hashed:]:
    raise ConfigError(f"{f.name('mlp_layer_types')} has a hash_moe layer after a moe layer; maxtext routes by hash only in the first layers")
  return hashed


def _rope(f: HFFields) -> dict[str, Any]:
  """The sliding layers' base (plain rope) and the compressed layers' rope: rope_parameters {main, compress}, or the
  older rope_theta, compress_rope_theta and rope_scaling."""
  params = f.values.get("rope_parameters") or {}
  if isinstance(params, dict) and isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
    main, compress = f.section("rope_parameters").section("main"), f.section("rope_parameters").section("compress")
    if main.text("rope_type", "default") != "default":
      raise ConfigError(f"{main.name('rope_type')} is '{main.values['rope_type']}'; DeepSeek V4's sliding layers rotate with plain rope: fix the file")
    theta, compress_theta = main.number("rope_theta", positive=True), compress.number("rope_theta", positive=True)
  else:
    key = "rope_scaling" if f.has("rope_scaling") else "rope_parameters"
    compress = f.section(key) if f.has(key) else HFFields({}, f.source, f"{key}.")
    theta, compress_theta = (
      f.number("rope_theta", DEFAULTS["rope_theta"], positive=True),
      f.number("compress_rope_theta", DEFAULTS["compress_rope_theta"], positive=True),
    )
  kind = compress.text("rope_type", None) or compress.text("type", "default")
  out: dict[str, Any] = {"rope_max_timescale": theta, "compressed_rope_max_timescale": compress_theta, "rope_type": kind}
  if kind == "yarn":
    if compress.number("attention_factor", 1.0) != 1.0:
      raise ConfigError(f"{compress.name('attention_factor')} is not 1; DeepSeek V4's compressed rope does not scale cos/sin: fix the file")
    out.update(
      rope_factor=compress.number("factor", positive=True),
      original_max_position_embeddings=compress.int("original_max_position_embeddings"),
      beta_fast=compress.number("beta_fast", 32.0),
      beta_slow=compress.number("beta_slow", 1.0),
      rope_attention_scaling=False,
    )
  elif kind != "default":
    raise ConfigError(f"{compress.name('rope_type')} '{kind}' is not supported for DeepSeek V4's compressed layers; supported: default, yarn")
  return out


def overrides(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
  """maxtext keys of a deepseek_v4 config.json; unknown layer or router types and features maxtext does not build are
  one-line ConfigErrors naming the field."""
  f = HFFields({**DEFAULTS, **hf}, source)
  for key in ("attention_bias", "mlp_bias"):
    if f.flag(key, False):
      raise ConfigError(f"{f.name(key)} is true; DeepSeek V4 has no biases there and maxtext builds none: fix the file")
  router = f.text("scoring_func")
  if router not in ROUTERS:
    raise ConfigError(f"{f.name('scoring_func')} is '{router}', an unknown router type; DeepSeek V4 routes with one of {', '.join(ROUTERS)}")
  if f.text("hidden_act") != "silu":
    raise ConfigError(f"{f.name('hidden_act')} is '{f.values['hidden_act']}'; DeepSeek V4's experts are SwiGLU: use silu")
  layers, head_dim = f.int("num_hidden_layers"), f.int("head_dim")
  ratios, csa = _layer_rates(f, layers)
  if f.has("partial_rotary_factor"):
    rope_dim = int(head_dim * f.number("partial_rotary_factor", positive=True))
  else:
    rope_dim = f.int("qk_rope_head_dim", head_dim // 8)
  out: dict[str, Any] = {
    "decoder_block": "deepseek4",
    "base_emb_dim": f.int("hidden_size"),
    "base_num_query_heads": f.int("num_attention_heads"),
    "base_num_kv_heads": 1,
    "head_dim": head_dim,
    "qk_rope_head_dim": rope_dim,
    "q_lora_rank": f.int("q_lora_rank"),
    "o_groups": f.int("o_groups"),
    "o_lora_rank": f.int("o_lora_rank"),
    "sliding_window_size": f.int("sliding_window"),
    "compress_ratios": ratios,
    "csa_compress_ratio": csa,
    "indexer_n_heads": f.int("index_n_heads"),
    "indexer_head_dim": f.int("index_head_dim"),
    "indexer_topk": f.int("index_topk"),
    "base_num_decoder_layers": layers,
    "base_mlp_dim": f.int("moe_intermediate_size"),
    "base_moe_mlp_dim": f.int("moe_intermediate_size"),
    "num_experts": f.int("n_routed_experts"),
    "num_experts_per_tok": f.int("num_experts_per_tok"),
    "shared_experts": f.int("n_shared_experts"),
    "first_num_hash_layers": _hash_layers(f, layers),
    "routed_score_func": router,
    "routed_bias": True,
    "norm_topk_prob": f.flag("norm_topk_prob", True),
    "routed_scaling_factor": f.number("routed_scaling_factor", positive=True),
    "mlp_activations": ["silu", "linear"],
    "mlp_activations_limit": f.number("swiglu_limit", positive=True),
    "mhc_expansion_rate": f.int("hc_mult"),
    "sinkhorn_iterations": f.int("hc_sinkhorn_iters"),
    "hc_eps": f.number("hc_eps", positive=True),
    "vocab_size": f.int("vocab_size"),
    "normalization_layer_epsilon": f.number("rms_norm_eps", positive=True),
    "logits_via_embedding": f.flag("tie_word_embeddings", False),
    "mtp_num_layers": 0,
    "global_parameter_scale": 1,
    **_rope(f),
  }
  dt = hf.get("dtype") or hf.get("torch_dtype")
  if dt in ("float32", "bfloat16", "float16"):
    out["dtype"] = dt
  return out


def export(c: Config) -> dict[str, Any]:
  """A DeepseekV4Config config.json for a deepseek4 maxtext config (transformers loads it)."""
  from maxtext.models import registry

  kinds = registry.get(c.decoder_block).kinds(c)
  rates: dict[str, int] = {}
  for kind in kinds:
    if kind.compress and rates.setdefault(kind.variant, kind.compress) != kind.compress:
      raise ConfigError(f"DeepSeek V4's config.json has one compress rate per layer type, but compress_ratios gives {kind.variant} layers several; use one")
  rates = {CSA: rates.get(CSA, c.csa_compress_ratio), HCA: rates.get(HCA, 128 if c.csa_compress_ratio != 128 else 64)}
  if c.mlp_activations != ["silu", "linear"]:
    raise ConfigError(f"mlp_activations {c.mlp_activations} have no DeepSeek V4 equivalent; use [silu, linear]")
  if not c.routed_bias:
    raise ConfigError("DeepSeek V4's routed layers hold a score-correction bias; export a deepseek4 model with routed_bias=true")
  compress: dict[str, Any] = {"rope_type": c.rope_type, "rope_theta": c.compressed_rope_max_timescale, "partial_rotary_factor": c.qk_rope_head_dim / c.head_dim}
  if c.rope_type == "yarn":
    if c.rope_attention_scaling:
      raise ConfigError("DeepSeek V4's compressed rope does not scale cos/sin; export a deepseek4 model with rope_attention_scaling=false")
    compress.update(
      factor=c.rope_factor,
      original_max_position_embeddings=c.original_max_position_embeddings,
      beta_fast=c.beta_fast,
      beta_slow=c.beta_slow,
      attention_factor=1.0,
    )
  elif c.rope_type != "default":
    raise ConfigError(f"rope_type={c.rope_type} has no DeepSeek V4 equivalent; use default or yarn")
  return {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": MODEL_TYPE,
    "vocab_size": c.vocab_size,
    "hidden_size": c.emb_dim,
    "moe_intermediate_size": c.moe_mlp_dim,
    "num_hidden_layers": c.num_decoder_layers,
    "num_attention_heads": c.num_query_heads,
    "num_key_value_heads": 1,
    "head_dim": c.head_dim,
    "partial_rotary_factor": c.qk_rope_head_dim / c.head_dim,
    "q_lora_rank": c.q_lora_rank,
    "o_groups": c.o_groups,
    "o_lora_rank": c.o_lora_rank,
    "sliding_window": c.sliding_window_size,
    "layer_types": [k.variant for k in kinds],
    "compress_rates": rates,
    "mlp_layer_types": ["hash_moe" if k.ffn == "moe_hash" else "moe" for k in kinds],
    "index_n_heads": c.indexer_n_heads,
    "index_head_dim": c.indexer_head_dim,
    "index_topk": c.indexer_topk,
    "n_routed_experts": c.num_experts,
    "num_experts_per_tok": c.num_experts_per_tok,
    "n_shared_experts": c.shared_experts,
    "scoring_func": c.routed_score_func or "softmax",
    "norm_topk_prob": c.norm_topk_prob,
    "routed_scaling_factor": c.routed_scaling_factor,
    "swiglu_limit": float(c.mlp_activations_limit),
    "hc_mult": c.mhc_expansion_rate,
    "hc_sinkhorn_iters": c.sinkhorn_iterations,
    "hc_eps": c.hc_eps,
    "rms_norm_eps": c.normalization_layer_epsilon,
    "tie_word_embeddings": c.logits_via_embedding,
    "hidden_act": "silu",
    "rope_parameters": {
      "main": {"rope_type": "default", "rope_theta": c.rope_max_timescale, "partial_rotary_factor": c.qk_rope_head_dim / c.head_dim},
      "compress": compress,
    },
    "max_position_embeddings": max(c.max_target_length, 4096),
    "num_nextn_predict_layers": 0,
    "dtype": c.weight_dtype,
  }
