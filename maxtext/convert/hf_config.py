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
  "gemma2": "Gemma2ForCausalLM",
}
HF_MODEL_TYPES = {"llama2": "llama", "mistral": "mistral", "mixtral": "mixtral", "qwen3": "qwen3", "gemma2": "gemma2"}


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
  elif kind != "default":
    raise ConfigError(f"rope type '{kind}' in config.json is not supported; supported: default, llama3")
  return out


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
    "use_qk_norm": model_type == "qwen3",
    "global_parameter_scale": 1,
    **_rope(hf),
  }
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise ConfigError("config.json uses attention or MLP biases, which maxtext models do not have")
  window = hf.get("sliding_window")
  uses_window = model_type == "gemma2" or (model_type == "mistral" and window) or (model_type == "qwen3" and hf.get("use_sliding_window"))
  out["sliding_window_size"] = int(window) if uses_window and window else 0
  if model_type == "gemma2":
    out["attn_logits_soft_cap"] = hf.get("attn_logit_softcapping")
    out["final_logits_soft_cap"] = hf.get("final_logit_softcapping")
    out["query_pre_attn_scalar"] = float(hf.get("query_pre_attn_scalar") or out["head_dim"])
  if model_type == "mixtral":
    out["num_experts"] = hf["num_local_experts"]
    out["num_experts_per_tok"] = hf["num_experts_per_tok"]
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
  if (c.num_experts > 1) != (c.decoder_block == "mixtral"):
    raise ConfigError(f"decoder_block '{c.decoder_block}' with num_experts={c.num_experts} has no Hugging Face equivalent; use mixtral for experts")
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
  if c.decoder_block in ("mistral", "mixtral", "qwen3"):
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
  return hf
