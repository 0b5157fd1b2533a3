"""A Hugging Face config.json for a maxtext config (transformers loads it), with the family-specific keys of each export."""

from __future__ import annotations

from typing import Any

from maxtext.convert import hf_deepseek_v4_config, hf_gemma4, hf_qwen3_vl
from maxtext.convert.hf_model_types import (
  GPT_OSS_SWIGLU_ALPHA,
  HF_ARCHITECTURES,
  HF_MODEL_TYPES,
  MOE_FAMILIES,
  TO_HF_ACTIVATIONS,
  UNBIASED_ATTENTION_TYPES,
)
from maxtext.convert.hf_rope import rope_export
from maxtext.errors import ConfigError
from maxtext.models import registry

# The run's config, read by attribute (a maxtext.config.MaxTextConfig; not imported: the config's loader reads this module)
Config = Any


def _int_if_whole(x: float) -> int | float:
  return int(x) if float(x).is_integer() else x


def hf_config_from(config: Config) -> dict[str, Any]:
  """A Hugging Face config.json for a maxtext config (transformers loads it)."""
  c = config
  if registry.get(c.decoder_block).gemma4_keys:
    return hf_gemma4.export(c)
  if registry.get(c.decoder_block).deepseek4_keys:
    return hf_deepseek_v4_config.export(c)
  if c.decoder_block == "qwen3_5" and c.num_experts > 1:  # MaxText's qwen3_5 model files are the MoE models
    c = c.model_copy(update={"decoder_block": "qwen3_5_moe"})
  if c.decoder_block not in HF_ARCHITECTURES:
    raise ConfigError(f"decoder_block '{c.decoder_block}' has no Hugging Face export")
  if (c.num_experts > 1) != (c.decoder_block in MOE_FAMILIES):
    raise ConfigError(
      f"decoder_block '{c.decoder_block}' with num_experts={c.num_experts} has no Hugging Face equivalent; experts need one of {', '.join(MOE_FAMILIES)}"
    )
  if c.mlp_activations[-1] != "linear" or len(c.mlp_activations) != 2:
    raise ConfigError(f"mlp_activations {c.mlp_activations} have no Hugging Face equivalent; use [<act>, linear]")
  if c.decoder_block == "gpt_oss" and c.mlp_activations != ["sigmoid", "linear"]:
    raise ConfigError(f"gpt_oss with mlp_activations {c.mlp_activations} has no Hugging Face equivalent; use [sigmoid, linear]")
  if c.mhc_expansion_rate > 1:
    raise ConfigError("mHC connectors have no Hugging Face equivalent; export a model with mhc_expansion_rate=1")
  if c.attention_bias and HF_MODEL_TYPES[c.decoder_block] in UNBIASED_ATTENTION_TYPES:
    raise ConfigError(f"{HF_ARCHITECTURES[c.decoder_block]} has no attention biases; export a {c.decoder_block} model with attention_bias=false")
  rope = rope_export(c, mla=bool({"mla", "mla_sparse"} & registry.get(c.decoder_block).mixers(c)))
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
    "hidden_act": "silu" if c.decoder_block == "gpt_oss" else TO_HF_ACTIVATIONS[c.mlp_activations[0]],  # GptOss ignores hidden_act
    "tie_word_embeddings": c.logits_via_embedding,
    "rope_parameters": rope,
    "rope_theta": c.rope_max_timescale,
    "max_position_embeddings": max(c.max_target_length, c.rope_original_max_position_embeddings),
    "attention_bias": c.attention_bias,
    "mlp_bias": False,
    "dtype": c.weight_dtype,
  }
  if c.rope_type in ("llama3.1", "yarn") or c.rope_linear_scaling_factor != 1.0:
    hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
  windows = registry.get(c.decoder_block).layer_windows(c)
  layer_types = ["sliding_attention" if w else "full_attention" for w in windows]
  if c.decoder_block in ("mistral", "mixtral", "qwen3", "qwen3_moe"):
    hf["sliding_window"] = c.sliding_window_size or None
    hf["use_sliding_window"] = bool(c.sliding_window_size)
  if c.decoder_block == "gemma" and (
    c.sliding_window_size or c.attn_logits_soft_cap or c.final_logits_soft_cap or c.query_pre_attn_scalar not in (0, c.head_dim)
  ):
    raise ConfigError(
      "GemmaForCausalLM attends in full, without soft caps, scaled by 1/sqrt(head_dim); export a gemma model with sliding_window_size=0, "
      "no attn_logits_soft_cap or final_logits_soft_cap and query_pre_attn_scalar=0"
    )
  if c.decoder_block in ("gemma2", "gemma3"):
    hf.update(
      hidden_activation=TO_HF_ACTIVATIONS[c.mlp_activations[0]],
      sliding_window=c.sliding_window_size,
      attn_logit_softcapping=c.attn_logits_soft_cap,
      final_logit_softcapping=c.final_logits_soft_cap,
      query_pre_attn_scalar=_int_if_whole(c.query_pre_attn_scalar or c.head_dim),
      layer_types=layer_types,
    )
  if c.decoder_block == "qwen2" and not c.attention_bias:
    raise ConfigError("Qwen2ForCausalLM always has q/k/v biases; export a qwen2 model with attention_bias=true")
  if c.decoder_block == "qwen2":
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_decoder_layers, layer_types=layer_types)
    hf.pop("attention_bias")
  if c.decoder_block == "olmo3":
    if not c.use_qk_norm:
      raise ConfigError("Olmo3ForCausalLM always normalises queries and keys; export an olmo3 model with use_qk_norm=true")
    local = {"rope_type": "default", "rope_theta": c.local_rope_max_timescale if c.local_rope_max_timescale > 0 else c.rope_max_timescale}
    if c.local_rope_max_timescale <= 0 and rope != local:
      raise ConfigError("olmo3 export with a scaled rope needs local_rope_max_timescale (Olmo3's sliding layers rotate with plain rope)")
    hf.update(rope_parameters={"full_attention": rope, "sliding_attention": local}, sliding_window=c.sliding_window_size, layer_types=layer_types)
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
  if c.decoder_block == "gemma3":
    if c.local_rope_max_timescale <= 0:
      raise ConfigError("gemma3 export needs local_rope_max_timescale (Gemma 3's sliding-window layers have their own rope base)")
    local = {"rope_type": "default", "rope_theta": c.local_rope_max_timescale}
    hf.update(rope_parameters={"full_attention": rope, "sliding_attention": local}, use_bidirectional_attention=False)
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
  if c.decoder_block == "gpt_oss":
    missing = [k for k in ("attention_sink", "attention_bias", "routed_bias", "mlp_bias", "norm_topk_prob") if not getattr(c, k)]
    if missing or c.mlp_activations_limit <= 0 or c.rope_type != "yarn" or c.routed_score_func == "sigmoid":
      raise ConfigError(
        f"this gpt_oss config has no Hugging Face equivalent ({', '.join(missing) or 'mlp_activations_limit, rope_type or routed_score_func'} differ); "
        "GptOss has sinks, q/k/v/o, router and expert biases, a softmax over the chosen experts, a clamped SwiGLU and yarn rope"
      )
    hf.update(
      sliding_window=c.sliding_window_size,
      layer_types=layer_types,
      num_local_experts=c.num_experts,
      num_experts_per_tok=c.num_experts_per_tok,
      intermediate_size=c.moe_mlp_dim,
      swiglu_alpha=GPT_OSS_SWIGLU_ALPHA,
      swiglu_limit=c.mlp_activations_limit,
      max_position_embeddings=max(c.max_target_length, c.original_max_position_embeddings * c.rope_factor),
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
  if c.decoder_block in ("deepseek", "deepseek_v32"):
    hf.update(_deepseek_export(c))
  if c.decoder_block == "deepseek_v32":
    if not c.rope_interleave:
      raise ConfigError("DeepseekV32 always rotates MLA's keys in interleaved pairs; export a deepseek_v32 model with rope_interleave=true")
    hf.update(index_n_heads=c.indexer_n_heads, index_head_dim=c.indexer_head_dim, index_topk=c.indexer_topk)
    hf.pop("rope_interleave")
  if c.decoder_block in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
    hf.update(_qwen3_next_export(c, rope))
  if c.decoder_block == "qwen3_5_moe":
    hf.pop("intermediate_size")  # Qwen3_5MoeTextConfig has none
  if c.decoder_block == "llama4":
    hf.update(_llama4_export(c, rope))
  if c.use_multimodal and c.vision_encoder_block == "qwen3_vl":
    return hf_qwen3_vl.export(c, hf)
  if c.use_multimodal and c.decoder_block == "llama4":
    from maxtext.vision.llama4_hf_config import llama4_vision_export

    return llama4_vision_export(c, hf)
  if c.use_multimodal:
    return _gemma3_vision_export(c, hf)
  return hf


def _qwen3_next_export(c: Config, rope: dict[str, Any]) -> dict[str, Any]:
  """config.json keys of a Qwen3NextForCausalLM: the hybrid layer types, Gated DeltaNet sizes, experts and the gated
  shared expert (which Qwen3-Next always has, as its query/key norms)."""
  arch = HF_ARCHITECTURES[c.decoder_block]
  if not c.use_qk_norm or (c.num_experts > 1 and not c.shared_experts):
    raise ConfigError(
      f"{arch} always has query/key norms (and with experts a shared expert); export a {c.decoder_block} model with use_qk_norm=true (and shared_experts >= 1)"
    )
  kinds = registry.get(c.decoder_block).kinds(c)
  linear = {
    "layer_types": ["full_attention" if k.mixer == "attention" else "linear_attention" for k in kinds],
    "full_attention_interval": c.inhomogeneous_layer_cycle_interval,
    "rope_parameters": {**rope, "partial_rotary_factor": c.partial_rotary_factor},
    "partial_rotary_factor": c.partial_rotary_factor,
    "linear_conv_kernel_dim": c.gdn_conv_kernel_dim,
    "linear_key_head_dim": c.gdn_key_head_dim,
    "linear_value_head_dim": c.gdn_value_head_dim,
    "linear_num_key_heads": c.gdn_num_key_heads,
    "linear_num_value_heads": c.gdn_num_value_heads,
  }
  if c.mtp_num_layers:
    linear["mtp_num_hidden_layers"] = c.mtp_num_layers
  if c.num_experts <= 1:
    return linear
  return {
    **linear,
    "num_experts": c.num_experts,
    "num_experts_per_tok": c.num_experts_per_tok,
    "moe_intermediate_size": c.moe_mlp_dim,
    "shared_expert_intermediate_size": c.shared_experts * c.moe_mlp_dim,
    "norm_topk_prob": c.norm_topk_prob,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
  }


def _deepseek_export(c: Config) -> dict[str, Any]:
  """config.json keys of a DeepseekV3 model (MLA, DeepSeekMoE, YaRN)."""
  if c.routed_score_func != "sigmoid" or not c.routed_bias:
    raise ConfigError("DeepseekV3 on Hugging Face routes with sigmoid scores and a score-correction bias; set routed_score_func=sigmoid and routed_bias=true")
  rope = rope_export(c, mla=True)
  groups = (c.n_routing_groups, c.topk_routing_group) if c.n_routing_groups > 0 else (1, 1)
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
    "n_group": groups[0],
    "topk_group": groups[1],
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
    "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if c.rope_type == "yarn" else None,
    "max_position_embeddings": max(c.max_target_length, c.original_max_position_embeddings * c.rope_factor),
  }


def _llama4_export(c: Config, rope: dict[str, Any]) -> dict[str, Any]:
  """config.json keys of a Llama4ForCausalLM (text): experts beside one shared expert, NoPE and chunked layers."""
  if c.shared_experts != 1 or c.num_experts_per_tok != 1:
    raise ConfigError("Llama4ForCausalLM has one shared expert and top-1 routing; export a llama4 model with shared_experts=1 and num_experts_per_tok=1")
  kinds = registry.get(c.decoder_block).kinds(c)
  nope = c.nope_layer_interval if c.nope_layer_interval > 0 else c.num_decoder_layers + 1
  rope = rope if c.rope_use_scale else {"rope_theta": c.rope_max_timescale, "rope_type": "default"}
  return {
    "intermediate_size": c.moe_mlp_dim,
    "intermediate_size_mlp": c.mlp_dim,
    "num_local_experts": c.num_experts,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": c.interleave_moe_layer_step,
    "moe_layers": [i for i, k in enumerate(kinds) if k.ffn != "dense"],
    "no_rope_layer_interval": nope,
    "no_rope_layers": [int(k.chunk > 0) for k in kinds],
    "layer_types": ["chunked_attention" if k.chunk else "full_attention" for k in kinds],
    "attention_chunk_size": c.chunk_attn_window_size,
    "use_qk_norm": c.use_qk_norm,
    "attn_temperature_tuning": c.temperature_tuning,
    "attn_scale": c.temperature_tuning_scale,
    "floor_scale": _int_if_whole(c.temperature_tuning_floor_scale),
    "rope_parameters": rope,
    "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default" else None,
  }


def _gemma3_vision_export(c: Config, text: dict[str, Any]) -> dict[str, Any]:
  """use_multimodal: the text config.json nested as a Gemma3ForConditionalGeneration's text_config, with its vision_config."""
  text = {k: v for k, v in text.items() if k != "architectures"}
  vision = {
    "model_type": "siglip_vision_model",
    "hidden_size": c.hidden_size_for_vit,
    "intermediate_size": c.intermediate_size_for_vit,
    "num_hidden_layers": c.num_hidden_layers_for_vit,
    "num_attention_heads": c.num_attention_heads_for_vit,
    "image_size": c.image_size_for_vit,
    "patch_size": c.patch_size_for_vit,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
    "vision_use_head": False,
  }
  return {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": text,
    "vision_config": vision,
    "mm_tokens_per_image": c.mm_tokens_per_image,
    "image_token_index": c.image_token_id,
    "tie_word_embeddings": c.logits_via_embedding,
    "dtype": c.weight_dtype,
  }
