"""Hugging Face config.json <-> maxtext config keys."""

from __future__ import annotations

from typing import Any

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError
from maxtext.models import registry

HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "gelu": "gelu_exact", "relu": "relu"}
TO_HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "gelu_exact": "gelu", "relu": "relu"}
HF_ARCHITECTURES = {
  "llama2": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "mixtral": "MixtralForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "gemma2": "Gemma2ForCausalLM",
  "deepseek": "DeepseekV3ForCausalLM",
}
HF_MODEL_TYPES = {
  "llama2": "llama",
  "mistral": "mistral",
  "mixtral": "mixtral",
  "qwen3": "qwen3",
  "qwen3_moe": "qwen3_moe",
  "gemma2": "gemma2",
  "deepseek": "deepseek_v3",
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek")


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
  params = dict(hf.get("rope_scaling") or {})
  params.update(hf.get("rope_parameters") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
  out: dict[str, Any] = {"rope_max_timescale": float(theta)}
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "llama3":
    out.update(
      rope_type="llama3.1",
      rope_scaling_factor=float(params["factor"]),
      rope_low_freq_factor=float(params["low_freq_factor"]),
      rope_high_freq_factor=float(params["high_freq_factor"]),
      rope_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
  elif kind == "yarn":
    out.update(_yarn(params))
  elif kind != "default":
    raise ConfigError(f"rope type '{kind}' in config.json is not supported; supported: default, llama3, yarn (deepseek_v3)")
  return out


def _yarn(params: dict[str, Any]) -> dict[str, Any]:
  """HF yarn parameters -> rope_factor, beta_*, original_max_position_embeddings, mscale, rope_attention_scaling, rope_truncate.

  HF scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (1 when they are
  equal, as in DeepSeek V3) and DeepSeek's softmax scale by mscale(factor, mscale_all_dim)^2; without them cos/sin
  get mscale(factor) and the softmax scale is unchanged.
  """
  factor = float(params["factor"])
  if not factor.is_integer():
    raise ConfigError(f"yarn factor {factor} in config.json is not a whole number; maxtext's rope_factor is an integer")
  m, m_all = params.get("mscale"), params.get("mscale_all_dim")
  if params.get("attention_factor") is not None:
    raise ConfigError("yarn attention_factor in config.json is not supported; remove it (it is derived from factor and mscale)")
  if m and m_all and m != m_all:
    raise ConfigError(f"yarn mscale {m} != mscale_all_dim {m_all} in config.json is not supported; maxtext has one mscale")
  both = bool(m and m_all)
  return {
    "rope_type": "yarn",
    "rope_factor": int(factor),
    "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
    "beta_fast": int(params.get("beta_fast") or 32),
    "beta_slow": int(params.get("beta_slow") or 1),
    "mscale": float(m_all) if m_all else 0.0,
    "rope_attention_scaling": not both,
    "rope_truncate": bool(params.get("truncate", True)),
  }


def _moe(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
  """Expert keys of qwen3_moe and deepseek_v3 config.json files."""
  if model_type == "qwen3_moe":
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
      raise ConfigError("qwen3_moe config.json with decoder_sparse_step != 1 or mlp_only_layers is not supported; every layer must be MoE")
    return {
      "num_experts": hf.get("num_experts") or hf["num_local_experts"],
      "num_experts_per_tok": hf["num_experts_per_tok"],
      "base_moe_mlp_dim": hf["moe_intermediate_size"],
      "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
    }
  heads = hf["num_attention_heads"]
  if (hf.get("num_key_value_heads") or heads) != heads:
    raise ConfigError("deepseek_v3 config.json with num_key_value_heads != num_attention_heads is not supported (MLA expands keys per head)")
  return {
    "base_num_kv_heads": heads,
    "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
    "num_experts": hf.get("n_routed_experts") or hf["num_local_experts"],
    "num_experts_per_tok": hf["num_experts_per_tok"],
    "base_moe_mlp_dim": hf["moe_intermediate_size"],
    "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
    "shared_experts": hf.get("n_shared_experts") or 0,
    "first_num_dense_layers": hf.get("first_k_dense_replace") or 0,
    "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
    "routed_score_func": "sigmoid",
    "routed_bias": True,
    "n_routing_groups": hf.get("n_group") or 1,
    "topk_routing_group": hf.get("topk_group") or 1,
    "q_lora_rank": hf.get("q_lora_rank") or 0,
    "kv_lora_rank": hf["kv_lora_rank"],
    "qk_nope_head_dim": hf["qk_nope_head_dim"],
    "qk_rope_head_dim": hf["qk_rope_head_dim"],
    "v_head_dim": hf["v_head_dim"],
    "rope_interleave": bool(hf.get("rope_interleave", True)),
  }


def overrides_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  """maxtext config keys describing the architecture in a Hugging Face config.json."""
  model_type = hf.get("model_type", "")
  family = registry.by_hf_model_type(model_type)
  if family is None:
    supported = sorted(t for f in registry.FAMILIES.values() for t in f.hf_model_types)
    raise ConfigError(f"Hugging Face model_type '{model_type}' is not supported; supported: {', '.join(supported)}")
  heads = hf["num_attention_heads"]
  act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
  if act not in HF_ACTIVATIONS:
    raise ConfigError(f"activation '{act}' in config.json is not supported; supported: {', '.join(HF_ACTIVATIONS)}")
  out: dict[str, Any] = {
    "decoder_block": family.name,
    "base_emb_dim": hf["hidden_size"],
    "base_num_query_heads": heads,
    "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
    "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
    "base_mlp_dim": hf["intermediate_size"],
    "base_num_decoder_layers": hf["num_hidden_layers"],
    "vocab_size": hf["vocab_size"],
    "normalization_layer_epsilon": hf.get("rms_norm_eps", 1e-6),
    "mlp_activations": [HF_ACTIVATIONS[act], "linear"],
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    "normalize_embedding_logits": False,
    "use_qk_norm": model_type in ("qwen3", "qwen3_moe"),
    "global_parameter_scale": 1,
    **_rope(hf),
  }
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise ConfigError("config.json uses attention or MLP biases, which maxtext models do not have")
  window = hf.get("sliding_window")
  uses_window = model_type == "gemma2" or (model_type == "mistral" and window) or (model_type in ("qwen3", "qwen3_moe") and hf.get("use_sliding_window"))
  out["sliding_window_size"] = int(window) if uses_window and window else 0
  if model_type == "gemma2":
    out["attn_logits_soft_cap"] = hf.get("attn_logit_softcapping")
    out["final_logits_soft_cap"] = hf.get("final_logit_softcapping")
    out["query_pre_attn_scalar"] = float(hf.get("query_pre_attn_scalar") or out["head_dim"])
  if model_type == "mixtral":
    out["num_experts"] = hf["num_local_experts"]
    out["num_experts_per_tok"] = hf["num_experts_per_tok"]
  if model_type in ("qwen3_moe", "deepseek_v3"):
    out.update(_moe(hf, model_type))
  if model_type == "deepseek_v3" and out.get("rope_type") != "yarn" and out.get("rope_interleave"):
    raise ConfigError("deepseek_v3 config.json with rope_interleave and a non-yarn rope is not supported; maxtext interleaves only with rope_type yarn")
  dt = hf.get("dtype") or hf.get("torch_dtype")
  if dt in ("float32", "bfloat16", "float16"):
    out["dtype"] = dt
  return out


def _int_if_whole(x: float) -> int | float:
  return int(x) if float(x).is_integer() else x


def hf_config_from(config: MaxTextConfig) -> dict[str, Any]:
  """A Hugging Face config.json for a maxtext config (transformers loads it)."""
  c = config
  if c.decoder_block not in HF_ARCHITECTURES:
    raise ConfigError(f"decoder_block '{c.decoder_block}' has no Hugging Face export")
  if (c.num_experts > 1) != (c.decoder_block in MOE_FAMILIES):
    raise ConfigError(
      f"decoder_block '{c.decoder_block}' with num_experts={c.num_experts} has no Hugging Face equivalent; experts need one of {', '.join(MOE_FAMILIES)}"
    )
  if c.mlp_activations[-1] != "linear" or len(c.mlp_activations) != 2:
    raise ConfigError(f"mlp_activations {c.mlp_activations} have no Hugging Face equivalent; use [<act>, linear]")
  rope: dict[str, Any] = {"rope_theta": c.rope_max_timescale, "rope_type": "default"}
  if c.rope_type == "llama3.1":
    rope.update(
      rope_type="llama3",
      factor=c.rope_scaling_factor,
      low_freq_factor=c.rope_low_freq_factor,
      high_freq_factor=c.rope_high_freq_factor,
      original_max_position_embeddings=c.rope_original_max_position_embeddings,
    )
  hf: dict[str, Any] = {
    "architectures": [HF_ARCHITECTURES[c.decoder_block]],
    "model_type": HF_MODEL_TYPES[c.decoder_block],
    "hidden_size": c.emb_dim,
    "num_attention_heads": c.num_query_heads,
    "num_key_value_heads": c.num_kv_heads,
    "head_dim": c.head_dim,
    "intermediate_size": c.mlp_dim,
    "num_hidden_layers": c.num_decoder_layers,
    "vocab_size": c.vocab_size,
    "rms_norm_eps": c.normalization_layer_epsilon,
    "hidden_act": TO_HF_ACTIVATIONS[c.mlp_activations[0]],
    "tie_word_embeddings": c.logits_via_embedding,
    "rope_parameters": rope,
    "rope_theta": c.rope_max_timescale,
    "max_position_embeddings": max(c.max_target_length, c.rope_original_max_position_embeddings),
    "attention_bias": False,
    "mlp_bias": False,
    "dtype": c.weight_dtype,
  }
  if c.rope_type == "llama3.1":
    hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
  if c.decoder_block in ("mistral", "mixtral", "qwen3", "qwen3_moe"):
    hf["sliding_window"] = c.sliding_window_size or None
    hf["use_sliding_window"] = bool(c.sliding_window_size)
  if c.decoder_block == "gemma2":
    hf.update(
      hidden_activation=TO_HF_ACTIVATIONS[c.mlp_activations[0]],
      sliding_window=c.sliding_window_size,
      attn_logit_softcapping=c.attn_logits_soft_cap,
      final_logit_softcapping=c.final_logits_soft_cap,
      query_pre_attn_scalar=_int_if_whole(c.query_pre_attn_scalar or c.head_dim),
      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c.num_decoder_layers)],
    )
  if c.decoder_block == "mixtral":
    hf.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
  if c.decoder_block == "qwen3_moe":
    hf.update(
      num_experts=c.num_experts,
      num_experts_per_tok=c.num_experts_per_tok,
      moe_intermediate_size=c.moe_mlp_dim,
      norm_topk_prob=c.norm_topk_prob,
      decoder_sparse_step=1,
      mlp_only_layers=[],
    )
  if c.decoder_block == "deepseek":
    hf.update(_deepseek_export(c))
  return hf


def _deepseek_export(c: MaxTextConfig) -> dict[str, Any]:
  """config.json keys of a DeepseekV3 model (MLA, DeepSeekMoE, YaRN)."""
  if c.routed_score_func != "sigmoid" or not c.routed_bias or c.n_routing_groups < 1:
    raise ConfigError("DeepseekV3 on Hugging Face routes with sigmoid scores, a score-correction bias and routing groups; set those keys")
  if c.rope_type != "yarn":
    raise ConfigError("deepseek export needs rope_type=yarn (Hugging Face DeepseekV3 interleaves rope pairs)")
  rope = {
    "rope_type": "yarn",
    "rope_theta": c.rope_max_timescale,
    "factor": float(c.rope_factor),
    "original_max_position_embeddings": c.original_max_position_embeddings,
    "beta_fast": c.beta_fast,
    "beta_slow": c.beta_slow,
    "truncate": c.rope_truncate,
  }
  if not c.rope_attention_scaling:
    if c.mscale == 0:
      raise ConfigError("yarn with mscale=0 and rope_attention_scaling=false has no Hugging Face equivalent")
    rope.update(mscale=c.mscale, mscale_all_dim=c.mscale)
  elif c.mscale != 0:
    raise ConfigError("yarn with rope_attention_scaling=true and mscale != 0 has no Hugging Face equivalent")
  return {
    "num_key_value_heads": c.num_query_heads,
    "head_dim": c.qk_rope_head_dim,
    "n_routed_experts": c.num_experts,
    "num_experts_per_tok": c.num_experts_per_tok,
    "moe_intermediate_size": c.moe_mlp_dim,
    "norm_topk_prob": c.norm_topk_prob,
    "n_shared_experts": c.shared_experts,
    "first_k_dense_replace": c.first_num_dense_layers,
    "routed_scaling_factor": c.routed_scaling_factor,
    "n_group": c.n_routing_groups,
    "topk_group": c.topk_routing_group,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "q_lora_rank": c.q_lora_rank or None,
    "kv_lora_rank": c.kv_lora_rank,
    "qk_nope_head_dim": c.qk_nope_head_dim,
    "qk_rope_head_dim": c.qk_rope_head_dim,
    "v_head_dim": c.v_head_dim,
    "rope_interleave": c.rope_interleave,
    "num_nextn_predict_layers": c.mtp_num_layers,
    "rope_parameters": rope,
    "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"},
    "max_position_embeddings": max(c.max_target_length, c.original_max_position_embeddings * c.rope_factor),
  }
