"""Hugging Face config.json <-> maxtext config keys."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from maxtext.convert import hf_deepseek_v4_config, hf_gemma4, hf_qwen3_vl, safetensors_io
from maxtext.convert.hf_fields import HFFields
from maxtext.errors import ConfigError, shorten
from maxtext.layers.rope import yarn_mscale
from maxtext.models import registry

# The run's config, read by attribute (a maxtext.config.MaxTextConfig; not imported: the config's loader reads this module)
Config = Any

HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "gelu": "gelu_exact", "relu": "relu"}
TO_HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "gelu_exact": "gelu", "relu": "relu"}
HF_ARCHITECTURES = {
  "llama2": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "mixtral": "MixtralForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "qwen3_next": "Qwen3NextForCausalLM",
  "qwen3_5": "Qwen3_5ForCausalLM",
  "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
  "gemma": "GemmaForCausalLM",
  "gemma2": "Gemma2ForCausalLM",
  "gemma3": "Gemma3ForCausalLM",
  "gpt_oss": "GptOssForCausalLM",
  "deepseek": "DeepseekV3ForCausalLM",
  "deepseek_v32": "DeepseekV32ForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "olmo3": "Olmo3ForCausalLM",
  "llama4": "Llama4ForCausalLM",
}
HF_MODEL_TYPES = {
  "llama2": "llama",
  "mistral": "mistral",
  "mixtral": "mixtral",
  "qwen3": "qwen3",
  "qwen3_moe": "qwen3_moe",
  "qwen3_next": "qwen3_next",
  "qwen3_5": "qwen3_5_text",
  "qwen3_5_moe": "qwen3_5_moe_text",
  "gemma": "gemma",
  "gemma2": "gemma2",
  "gemma3": "gemma3_text",
  "gpt_oss": "gpt_oss",
  "deepseek": "deepseek_v3",
  "deepseek_v32": "deepseek_v32",
  "qwen2": "qwen2",
  "olmo3": "olmo3",
  "llama4": "llama4_text",
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss", "deepseek", "llama4", "deepseek_v32")
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v32")  # MLA and DeepSeekMoE; deepseek_v32 adds the lightning indexer
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # Gated DeltaNet layers beside gated full attention
QWEN3_5_MULTIMODAL = ("qwen3_5", "qwen3_5_moe")  # config.json of the vision-language checkpoints: the decoder is text_config
WINDOWED_TYPES = ("gemma2", "gemma3_text", "gpt_oss", "olmo3")  # model types whose layer_types alternate sliding and full attention
# Model types whose transformers attention puts a bias on q, k, v and o exactly when attention_bias is true (maxtext's
# attention_bias); MistralAttention and MixtralAttention have no biases whatever the key says.
BIASED_ATTENTION_TYPES = ("llama", "qwen3", "qwen3_moe", *HYBRID_TYPES, "gemma", "gemma2", "gemma3_text", "gpt_oss", "olmo3", "llama4_text")
UNBIASED_ATTENTION_TYPES = ("mistral", "mixtral")
# Gemma3TextConfig defaults for the fields a multimodal Gemma 3 config.json may leave out of its text_config.
GEMMA3_TEXT_DEFAULTS = {
  "vocab_size": 262_208,
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "num_hidden_layers": 26,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "rms_norm_eps": 1e-6,
  "rope_theta": 1_000_000.0,
  "rope_local_base_freq": 10_000.0,
  "query_pre_attn_scalar": 256,
  "sliding_window": 4096,
  "tie_word_embeddings": True,
}
GPT_OSS_SWIGLU_ALPHA = 1.702  # the sigmoid gain maxtext's clamped SwiGLU uses (MaxText's too)


def _rope(hf: HFFields) -> dict[str, Any]:
  """Rotary keys of a config.json: rope_parameters (transformers 5) or rope_theta + rope_scaling; Gemma 3's per-layer-type
  parameters give the global layers' rope and local_rope_max_timescale."""
  scaling, parameters = hf.section("rope_scaling"), hf.section("rope_parameters")
  merged = {**scaling.values, **parameters.values}
  names = {k: ("rope_parameters." if k in parameters.values else "rope_scaling.") + k for k in merged}
  params = HFFields(merged, hf.source, "rope_parameters." if parameters.values else "rope_scaling.", names)  # a missing key: the section set
  theta, local_theta = hf.number("rope_theta", 10_000.0, positive=True), hf.number("rope_local_base_freq", None, positive=True)
  local: HFFields | None = None
  if "full_attention" in merged or "sliding_attention" in merged:  # per layer type (gemma3)
    local, params = params.section("sliding_attention"), params.section("full_attention")
  elif local_theta is not None:
    local = HFFields({}, hf.source)
  elif hf.values.get("model_type") == "olmo3":  # transformers 5 applies a legacy rope_scaling to Olmo3's full layers only
    local = HFFields({"rope_theta": theta}, hf.source)
  out: dict[str, Any] = {"rope_max_timescale": params.number("rope_theta", theta, positive=True)}
  kind = params.text("rope_type", None) or params.text("type", "default")
  if kind == "llama3":
    out.update(
      rope_type="llama3.1",
      rope_scaling_factor=params.number("factor", positive=True),
      rope_low_freq_factor=params.number("low_freq_factor", positive=True),
      rope_high_freq_factor=params.number("high_freq_factor", positive=True),
      rope_original_max_position_embeddings=params.int("original_max_position_embeddings"),
    )
  elif kind == "yarn":
    out.update(_yarn(params))
  elif kind == "linear":
    out["rope_linear_scaling_factor"] = params.number("factor", positive=True)
  elif kind != "default":
    raise ConfigError(f"rope type '{kind}' in config.json is not supported; supported: default, linear, llama3, yarn")
  if local is not None:
    if (local.text("rope_type", None) or local.text("type", "default")) != "default":
      raise ConfigError("config.json scales the sliding-window layers' rope; maxtext's local layers use plain rope (local_rope_max_timescale)")
    out["local_rope_max_timescale"] = local.number("rope_theta", local_theta or 10_000.0, positive=True)
  return out


def _yarn(params: HFFields) -> dict[str, Any]:
  """HF yarn parameters -> rope_factor, beta_*, original_max_position_embeddings, mscale, rope_attention_scaling, rope_truncate.

  HF scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (1 when they are
  equal, as in DeepSeek V3) and DeepSeek's softmax scale by mscale(factor, mscale_all_dim)^2; without them cos/sin
  get mscale(factor) and the softmax scale is unchanged.
  """
  factor = params.number("factor", positive=True)
  if not factor.is_integer():
    raise ConfigError(f"yarn factor {factor} in config.json is not a whole number; maxtext's rope_factor is an integer")
  m, m_all = params.number("mscale", None, minimum=0), params.number("mscale_all_dim", None, minimum=0)
  attention_factor = params.number("attention_factor", None, positive=True)
  if attention_factor is not None and (m or m_all or abs(attention_factor - yarn_mscale(factor)) > 1e-6):
    raise ConfigError(
      f"yarn attention_factor {attention_factor} in config.json is not supported; maxtext derives it from factor and mscale "
      f"(0.1 ln(factor) + 1 = {yarn_mscale(factor)}): remove it"
    )
  if m and m_all and m != m_all:
    raise ConfigError(f"yarn mscale {m} != mscale_all_dim {m_all} in config.json is not supported; maxtext has one mscale")
  both = bool(m and m_all)
  return {
    "rope_type": "yarn",
    "rope_factor": int(factor),
    "original_max_position_embeddings": params.int("original_max_position_embeddings"),
    "beta_fast": params.int("beta_fast", 32),
    "beta_slow": params.int("beta_slow", 1),
    "mscale": m_all or 0.0,
    "rope_attention_scaling": not both,
    "rope_truncate": params.flag("truncate", True),
  }


def _experts(hf: HFFields, *keys: str) -> int:
  """The expert count, from the first of keys the config.json sets (families name it differently)."""
  for key in keys:
    if hf.has(key):
      return hf.int(key)
  return hf.int(keys[0])  # none set: the error names the family's own key


def _moe(hf: HFFields, model_type: str) -> dict[str, Any]:
  """Expert keys of qwen3_moe and deepseek_v3 config.json files."""
  if model_type == "qwen3_moe":
    if hf.int("decoder_sparse_step", 1) != 1 or hf.values.get("mlp_only_layers"):
      raise ConfigError("qwen3_moe config.json with decoder_sparse_step != 1 or mlp_only_layers is not supported; every layer must be MoE")
    return {
      "num_experts": _experts(hf, "num_experts", "num_local_experts"),
      "num_experts_per_tok": hf.int("num_experts_per_tok"),
      "base_moe_mlp_dim": hf.int("moe_intermediate_size"),
      "norm_topk_prob": hf.flag("norm_topk_prob", False),
    }
  heads = hf.int("num_attention_heads")
  if hf.int("num_key_value_heads", heads) != heads:
    raise ConfigError("deepseek_v3 config.json with num_key_value_heads != num_attention_heads is not supported (MLA expands keys per head)")
  groups = hf.int("n_group", 1)
  nope, rope = hf.int("qk_nope_head_dim"), hf.int("qk_rope_head_dim")
  return {
    "base_num_kv_heads": heads,
    "head_dim": nope + rope,
    "num_experts": _experts(hf, "n_routed_experts", "num_local_experts"),
    "num_experts_per_tok": hf.int("num_experts_per_tok"),
    "base_moe_mlp_dim": hf.int("moe_intermediate_size"),
    "norm_topk_prob": hf.flag("norm_topk_prob", True),
    "shared_experts": hf.int("n_shared_experts", 0, minimum=0),
    "first_num_dense_layers": hf.int("first_k_dense_replace", 0, minimum=0),
    "routed_scaling_factor": hf.number("routed_scaling_factor", 1.0, positive=True),
    "routed_score_func": "sigmoid",
    "routed_bias": True,
    # One group (Kimi K2 and others) keeps every expert: the same routing as no groups.
    "n_routing_groups": -1 if groups == 1 else groups,
    "topk_routing_group": -1 if groups == 1 else hf.int("topk_group", 1),
    "q_lora_rank": hf.int("q_lora_rank", 0, minimum=0),
    "kv_lora_rank": hf.int("kv_lora_rank"),
    "qk_nope_head_dim": nope,
    "qk_rope_head_dim": rope,
    "v_head_dim": hf.int("v_head_dim"),
    "rope_interleave": hf.flag("rope_interleave", True),
    **(_indexer(hf) if model_type == "deepseek_v32" else {}),
  }


def _indexer(hf: HFFields) -> dict[str, Any]:
  """DeepseekV32's lightning indexer (it always rotates MLA's keys in interleaved pairs and has a query latent)."""
  layers = hf.int("num_hidden_layers")
  types = hf.texts("layer_types")
  if types is not None and types != ["indexed_attention"] * layers:
    raise ConfigError(f"config.json's layer_types must be {layers} x 'indexed_attention' (DeepseekV32 indexes every layer); fix layer_types")
  dense = min(hf.int("first_k_dense_replace", 3, minimum=0), layers)
  mlp_types = hf.texts("mlp_layer_types")
  if mlp_types is not None and mlp_types != ["dense"] * dense + ["sparse"] * (layers - dense):
    raise ConfigError(f"config.json's mlp_layer_types must be first_k_dense_replace={dense} 'dense' then 'sparse' layers; fix one of them")
  if not hf.int("q_lora_rank", 0, minimum=0):
    raise ConfigError("DeepseekV32 config.json needs q_lora_rank (its indexer projects the query latent); set it")
  return {
    "use_indexer": True,
    "indexer_n_heads": hf.int("index_n_heads", 64),
    "indexer_head_dim": hf.int("index_head_dim", 128),
    "indexer_topk": hf.int("index_topk", 2048),
    "rope_interleave": True,
  }


def text_config(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
  """The decoder's config.json fields: a multimodal Gemma 3 config's text_config (with Gemma3TextConfig's defaults for
  what it leaves out), else hf itself."""
  if hf.get("model_type") == "llama4":  # Llama4ForConditionalGeneration: the text decoder's own config
    text = {**HFFields(hf, source).section("text_config").values, "model_type": "llama4_text"}
    if "dtype" not in text and "torch_dtype" not in text:
      text["dtype"] = hf.get("dtype") or hf.get("torch_dtype")
    return text
  if hf.get("model_type") in hf_qwen3_vl.MODEL_TYPES:
    return hf_qwen3_vl.text_config(hf, source)
  if hf.get("model_type") in QWEN3_5_MULTIMODAL:
    text = {**HFFields(hf, source).section("text_config").values}
    text.setdefault("model_type", hf["model_type"] + "_text")
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text
  if hf.get("model_type") != "gemma3":
    return hf
  text = {**GEMMA3_TEXT_DEFAULTS, **HFFields(hf, source).section("text_config").values, "model_type": "gemma3_text"}
  if "dtype" not in text and "torch_dtype" not in text:
    text["dtype"] = hf.get("dtype") or hf.get("torch_dtype")
  return text


def _layer_types(hf: HFFields, family_windows: list[int]) -> None:
  """config.json's layer_types (or Gemma's sliding_window_pattern) must be the family's pattern of sliding and full layers."""
  layers = hf.int("num_hidden_layers")
  expected = ["sliding_attention" if w else "full_attention" for w in family_windows]
  key = "sliding_window_pattern" if hf.has("sliding_window_pattern") else "_sliding_window_pattern"
  pattern = hf.int(key, None)
  if pattern is not None and hf.values.get("model_type") == "gemma3_text" and pattern != 6:
    raise ConfigError(f"config.json's sliding_window_pattern {pattern} is not Gemma 3's 6 (5 local layers, 1 global); maxtext's gemma3 has that pattern")
  types = hf.texts("layer_types")
  if types is None:
    return
  if len(types) != layers:
    raise ConfigError(f"config.json lists {len(types)} layer_types for num_hidden_layers={layers}; the two contradict each other, fix one")
  if types != expected:
    first = next(i for i, (a, b) in enumerate(zip(types, expected)) if a != b)
    raise ConfigError(
      f"config.json's layer_types say layer {first} is {types[first]}, but {hf.values['model_type']} alternates as {expected[: min(layers, 6)]}...; "
      "maxtext follows the family's pattern: fix layer_types"
    )


def _check_consistent(hf: HFFields) -> None:
  """Fields of one config.json that contradict each other: a one-line ConfigError naming them."""
  heads = hf.int("num_attention_heads")
  kv = hf.int("num_key_value_heads", heads)
  if heads % kv:
    raise ConfigError(f"config.json has num_attention_heads={heads}, not a multiple of num_key_value_heads={kv}; the two contradict each other")
  experts = next((hf.int(k, minimum=0) for k in ("n_routed_experts", "num_local_experts", "num_experts") if hf.has(k)), 0)
  per_token = hf.int("num_experts_per_tok", 0, minimum=0)
  if experts and per_token > experts:
    raise ConfigError(f"config.json routes num_experts_per_tok={per_token} of only {experts} experts; the two contradict each other")
  if hf.values.get("model_type") in DEEPSEEK_TYPES:
    experts = _experts(hf, "n_routed_experts", "num_local_experts")
    groups, topk = hf.int("n_group", 1), hf.int("topk_group", 1)
    if experts % groups or not 1 <= topk <= groups:
      raise ConfigError(
        f"config.json has n_group={groups}, topk_group={topk} for n_routed_experts={experts}; n_group must divide the experts and topk_group <= n_group"
      )
    dense, layers = hf.int("first_k_dense_replace", 0, minimum=0), hf.int("num_hidden_layers")
    if dense >= layers:
      raise ConfigError(f"config.json has first_k_dense_replace={dense} for num_hidden_layers={layers}, which leaves no MoE layer; fix one of them")
    nope, rope = hf.int("qk_nope_head_dim"), hf.int("qk_rope_head_dim")
    head_dim = hf.int("head_dim", None)
    if head_dim not in (None, rope):
      raise ConfigError(f"config.json has head_dim={head_dim} but qk_rope_head_dim={rope}; DeepseekV3 sets head_dim to qk_rope_head_dim")
    qk = hf.int("qk_head_dim", None)
    if qk is not None and qk != nope + rope:
      raise ConfigError(f"config.json has qk_head_dim={qk}, not qk_nope_head_dim + qk_rope_head_dim = {nope + rope}")


def _qwen2_full_attention(hf: HFFields) -> None:
  """A qwen2 config.json must attend fully on every layer: maxtext's qwen2 has no sliding layers (use_sliding_window
  makes the layers from max_window_layers on slide in transformers)."""
  layers = hf.int("num_hidden_layers")
  sliding_from = hf.int("max_window_layers", 28, minimum=0)
  if hf.flag("use_sliding_window", False) and hf.int("sliding_window", 4096, minimum=0) and sliding_from < layers:
    raise ConfigError(
      f"qwen2 config.json sets use_sliding_window=true (layers {sliding_from}.. slide), which maxtext's qwen2 does not build; "
      "set use_sliding_window=false (as Qwen2.5 checkpoints do)"
    )
  _layer_types(hf, [0] * layers)


def _gpt_oss(hf: HFFields) -> dict[str, Any]:
  """Expert, bias, sink and activation keys of a gpt_oss config.json."""
  alpha = hf.number("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)
  if alpha != GPT_OSS_SWIGLU_ALPHA:
    raise ConfigError(f"gpt_oss config.json has swiglu_alpha={alpha}; maxtext's clamped SwiGLU uses {GPT_OSS_SWIGLU_ALPHA}")
  if not hf.flag("attention_bias", True):
    raise ConfigError("gpt_oss config.json with attention_bias=false is not supported; gpt-oss checkpoints have q/k/v/o biases")
  return {
    "num_experts": _experts(hf, "num_local_experts", "num_experts"),
    "num_experts_per_tok": hf.int("num_experts_per_tok"),
    "base_moe_mlp_dim": hf.int("intermediate_size"),
    "norm_topk_prob": True,  # a softmax over the chosen experts' logits
    "routed_bias": True,  # the router's bias on its logits
    "mlp_bias": True,
    "mlp_activations": ["sigmoid", "linear"],
    "mlp_activations_limit": hf.number("swiglu_limit", 7.0, positive=True),
    "attention_bias": True,
    "attention_sink": True,
    "rope_interleave": False,  # GptOss rotates split halves
  }


def _qwen3_next(hf: HFFields, family: str = "qwen3_next") -> dict[str, Any]:
  """Hybrid-attention, Gated DeltaNet and expert keys of a qwen3_next, qwen3_5_text or qwen3_5_moe_text config.json
  (qwen3_5_text: dense, no expert keys); its layer_types must be the family's pattern: per full_attention_interval
  layers, linear attention then one full attention layer."""
  layers = hf.int("num_hidden_layers")
  types = hf.texts("layer_types")
  if types is not None:
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
      raise ConfigError(f"config.json's layer_types has unknown type(s) {', '.join(unknown)}; {family} has linear_attention and full_attention")
    if len(types) != layers:
      raise ConfigError(f"config.json lists {len(types)} layer_types for num_hidden_layers={layers}; the two contradict each other, fix one")
  full = [i for i, t in enumerate(types or []) if t == "full_attention"]
  interval = hf.int("full_attention_interval", full[0] + 1 if full else (layers + 1 if types else 4), minimum=1)
  expected = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
  if types is not None and types != expected:
    raise ConfigError(
      f"config.json's layer_types are not {interval - 1} linear_attention layers then one full_attention layer, repeated; "
      f"maxtext's {family} has that pattern: fix layer_types"
    )
  keys, values = hf.int("linear_num_key_heads"), hf.int("linear_num_value_heads")
  if values % keys:
    raise ConfigError(f"config.json has linear_num_value_heads={values}, not a multiple of linear_num_key_heads={keys}; the two contradict each other")
  rope = {**hf.section("rope_scaling").values, **hf.section("rope_parameters").values}
  out = {
    "inhomogeneous_layer_cycle_interval": interval,
    "gdn_conv_kernel_dim": hf.int("linear_conv_kernel_dim", 4),
    "gdn_key_head_dim": hf.int("linear_key_head_dim"),
    "gdn_value_head_dim": hf.int("linear_value_head_dim"),
    "gdn_num_key_heads": keys,
    "gdn_num_value_heads": values,
    "partial_rotary_factor": float(rope.get("partial_rotary_factor", hf.number("partial_rotary_factor", 0.25, positive=True))),
  }
  if hf.values.get("model_type") == "qwen3_5_text":
    return out
  if hf.int("decoder_sparse_step", 1) != 1 or hf.values.get("mlp_only_layers"):
    raise ConfigError(f"{family} config.json with decoder_sparse_step != 1 or mlp_only_layers is not supported; every layer must be MoE")
  width, shared = hf.int("moe_intermediate_size"), hf.int("shared_expert_intermediate_size", 0, minimum=0)
  if shared % width:
    raise ConfigError(
      f"config.json's shared_expert_intermediate_size={shared} is not a multiple of moe_intermediate_size={width}; maxtext sizes shared experts so"
    )
  return {
    **out,
    "num_experts": hf.int("num_experts"),
    "num_experts_per_tok": hf.int("num_experts_per_tok"),
    "base_moe_mlp_dim": width,
    "shared_experts": shared // width,
    "norm_topk_prob": hf.flag("norm_topk_prob", True),
  }


def _llama4(hf: HFFields) -> dict[str, Any]:
  """Expert, NoPE, chunked-attention and temperature keys of a llama4_text config; its moe_layers, no_rope_layers and
  layer_types must be the family's pattern of interleave_moe_layer_step and no_rope_layer_interval."""
  layers, step, nope = hf.int("num_hidden_layers"), hf.int("interleave_moe_layer_step", 1, minimum=1), hf.int("no_rope_layer_interval", 4, minimum=1)
  chunk = hf.int("attention_chunk_size", 8192, minimum=1) if hf.values.get("attention_chunk_size", 8192) is not None else None
  if chunk is None:
    raise ConfigError("llama4 config.json with attention_chunk_size=null (full attention on the rope layers) is not built; maxtext's llama4 chunks them")
  if hf.int("num_experts_per_tok", 1) != 1:
    raise ConfigError(f"llama4 config.json routes num_experts_per_tok={hf.int('num_experts_per_tok')}; maxtext's llama4 weights expert inputs for top-1 only")
  rope_flags = hf.values.get("no_rope_layers") or [int((i + 1) % nope != 0) for i in range(layers)]
  if len(rope_flags) != layers:
    raise ConfigError(f"config.json lists {len(rope_flags)} no_rope_layers for num_hidden_layers={layers}; the two contradict each other, fix one")
  if list(rope_flags) != [int((i + 1) % nope != 0) for i in range(layers)]:
    raise ConfigError(
      f"config.json's no_rope_layers are not layers {nope - 1}, {2 * nope - 1}, ... NoPE (no_rope_layer_interval={nope}); maxtext's llama4 has that pattern: fix one"
    )
  moe = hf.values.get("moe_layers")
  if moe is not None and list(moe) != list(range(step - 1, layers, step)):
    raise ConfigError(
      f"config.json's moe_layers {shorten([str(i) for i in moe])} are not the layers {step - 1}, {2 * step - 1}, ... of {layers} that "
      f"interleave_moe_layer_step={step} makes MoE; fix one of them"
    )
  types = hf.texts("layer_types")
  if types is not None and types != ["chunked_attention" if r else "full_attention" for r in rope_flags]:
    raise ConfigError("config.json's layer_types are not chunked_attention on the rope layers and full_attention on the NoPE layers; fix layer_types")
  tuning = hf.values.get("attn_temperature_tuning", True)  # early configs hold a number (truthy) here
  return {
    "base_mlp_dim": hf.int("intermediate_size_mlp", 16384),
    "base_moe_mlp_dim": hf.int("intermediate_size"),
    "num_experts": hf.int("num_local_experts", 16),
    "num_experts_per_tok": 1,
    "shared_experts": 1,
    "interleave_moe_layer_step": step,
    "nope_layer_interval": nope,
    "inhomogeneous_layer_cycle_interval": math.lcm(step, nope),
    "chunk_attn_window_size": chunk,
    "use_qk_norm": hf.flag("use_qk_norm", True),
    "temperature_tuning": bool(tuning),
    "temperature_tuning_scale": hf.number("attn_scale", 0.1),
    "temperature_tuning_floor_scale": hf.number("floor_scale", 8192, positive=True),
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


def stored_mtp_layers(hf: dict[str, Any], source: str = "config.json") -> int:
  """How many multi-token-prediction layers the checkpoint stores past num_hidden_layers (DeepSeek's
  num_nextn_predict_layers; no other family stores any)."""
  if hf.get("model_type") not in DEEPSEEK_TYPES:
    return 0
  return HFFields(hf, source).int("num_nextn_predict_layers", 0, minimum=0)


def read_overrides(hf_dir: str | Path) -> dict[str, Any]:
  """overrides_from_hf of the directory's config.json, its messages naming the file."""
  return overrides_from_hf(safetensors_io.read_config(hf_dir), source=str(Path(hf_dir) / "config.json"))


def overrides_from_hf(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
  """maxtext config keys describing the architecture in a Hugging Face config.json (source: how messages name it).
  Every field read is checked for its type and range (maxtext.convert.hf_fields)."""
  if hf.get("model_type") in hf_gemma4.MODEL_TYPES:
    return hf_gemma4.overrides(hf, source)
  if hf.get("model_type") == hf_deepseek_v4_config.MODEL_TYPE:
    return hf_deepseek_v4_config.overrides(hf, source)
  prefix = "text_config." if hf.get("model_type") in ("gemma3", "llama4", *QWEN3_5_MULTIMODAL, *hf_qwen3_vl.MODEL_TYPES) else ""
  f = HFFields(text_config(hf, source), source, prefix)
  model_type = f.text("model_type", "")
  family = registry.by_hf_model_type(model_type)
  if family is None:
    supported = sorted(t for f in registry.FAMILIES.values() for t in f.hf_model_types)
    raise ConfigError(f"Hugging Face model_type '{model_type}' is not supported; supported: {', '.join(supported)}")
  _check_consistent(f)
  heads, hidden = f.int("num_attention_heads"), f.int("hidden_size")
  act = f.text("hidden_activation", None) or f.text("hidden_act", "silu")
  if model_type == "gemma" and act == "gelu":  # GemmaConfig reads the releases' legacy "gelu" as the tanh approximation
    act = "gelu_pytorch_tanh"
  if act not in HF_ACTIVATIONS:
    raise ConfigError(f"activation '{act}' in config.json is not supported; supported: {', '.join(HF_ACTIVATIONS)}")
  layers = f.int("num_hidden_layers")
  out: dict[str, Any] = {
    "decoder_block": family.name,
    "base_emb_dim": hidden,
    "base_num_query_heads": heads,
    "base_num_kv_heads": f.int("num_key_value_heads", heads),
    "head_dim": f.int("head_dim", None) or hidden // heads,
    "base_mlp_dim": f.int("moe_intermediate_size" if model_type == "qwen3_5_moe_text" and not f.has("intermediate_size") else "intermediate_size"),
    "base_num_decoder_layers": layers,
    "vocab_size": f.int("vocab_size"),
    "normalization_layer_epsilon": f.number("rms_norm_eps", 1e-6, positive=True),
    "mlp_activations": [HF_ACTIVATIONS[act], "linear"],
    "logits_via_embedding": f.flag("tie_word_embeddings", False),
    "normalize_embedding_logits": False,
    "use_qk_norm": model_type in ("qwen3", "qwen3_moe", *HYBRID_TYPES, "gemma3_text", "olmo3"),
    "global_parameter_scale": 1,
    **_rope(f),
  }
  if f.flag("mlp_bias", False):
    raise ConfigError("config.json uses dense MLP biases, which maxtext's dense MLPs do not have")
  attention_bias = f.flag("attention_bias", False)
  if model_type == "qwen2":  # Qwen2Attention always has q/k/v biases, whatever attention_bias says
    out["attention_bias"] = True
    _qwen2_full_attention(f)
  elif attention_bias and model_type in BIASED_ATTENTION_TYPES:
    out["attention_bias"] = True
  elif attention_bias and model_type not in UNBIASED_ATTENTION_TYPES:
    raise ConfigError(f"config.json uses attention biases, which maxtext's {family.name} attention does not have")
  if model_type == "gemma3_text" and f.flag("use_bidirectional_attention", False):
    raise ConfigError("config.json sets use_bidirectional_attention; maxtext's gemma3 is a causal decoder")
  window = f.int("sliding_window", None, minimum=0)
  use_window = model_type in ("qwen3", "qwen3_moe") and f.flag("use_sliding_window", False)
  uses_window = model_type in WINDOWED_TYPES or (model_type == "mistral" and window) or use_window
  out["sliding_window_size"] = window if uses_window and window else 0
  if model_type in ("gemma2", "gemma3_text"):
    out["attn_logits_soft_cap"] = f.number("attn_logit_softcapping", None, positive=True)
    out["final_logits_soft_cap"] = f.number("final_logit_softcapping", None, positive=True)
    out["query_pre_attn_scalar"] = f.number("query_pre_attn_scalar", None, positive=True) or float(out["head_dim"])
  if model_type in WINDOWED_TYPES:
    shape = SimpleNamespace(
      num_decoder_layers=layers, sliding_window_size=max(out["sliding_window_size"], 1), first_num_dense_layers=0, num_experts=1, shared_experts=0
    )
    _layer_types(f, family.layer_windows(shape))  # type: ignore[arg-type]
  if model_type == "mixtral":
    out["num_experts"] = f.int("num_local_experts")
    out["num_experts_per_tok"] = f.int("num_experts_per_tok")
  if out.get("rope_type") == "yarn" and model_type not in DEEPSEEK_TYPES:  # deepseek_v3 (MLA) reads rope_interleave
    out["rope_interleave"] = False  # transformers' grouped-query attention rotates split halves (maxtext's yarn default pairs neighbours)
  if model_type == "gpt_oss":
    out.update(_gpt_oss(f))
  if model_type in ("qwen3_moe", *DEEPSEEK_TYPES):
    out.update(_moe(f, model_type))
  if model_type in HYBRID_TYPES:
    out.update(_qwen3_next(f, family.name))
  if model_type == "llama4_text":
    out.update(_llama4(f))
  dt = f.text("dtype", None) or f.text("torch_dtype", None)
  if dt in ("float32", "bfloat16", "float16"):
    out["dtype"] = dt
  if hf.get("model_type") == "gemma3" and "vision_config" in hf:
    out.update(_gemma3_vision(HFFields(hf, source)))
  if hf.get("model_type") in hf_qwen3_vl.MODEL_TYPES:
    out.update(hf_qwen3_vl.vision_overrides(HFFields(hf, source)))
  if hf.get("model_type") == "llama4" and "vision_config" in hf:
    from maxtext.vision.llama4_hf_config import llama4_vision_keys

    out.update(llama4_vision_keys(HFFields(hf, source)))
  return out


SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224, "patch_size": 16}


def _gemma3_vision(hf: HFFields) -> dict[str, Any]:
  """A Gemma3ForConditionalGeneration's vision_config, mm_tokens_per_image and image_token_index -> the *_for_vit keys
  (use_multimodal=true: the tower and projector load beside the decoder; pass use_multimodal=false for the text decoder)."""
  v = HFFields({**SIGLIP_DEFAULTS, **hf.section("vision_config").values}, hf.source, "vision_config.")
  if v.flag("vision_use_head", False):
    raise ConfigError("config.json's vision_config sets vision_use_head; Gemma 3's SigLIP tower here has no pooling head")
  if (
    v.int("num_channels", 3) != 3 or v.number("layer_norm_eps", 1e-6, positive=True) != 1e-6 or v.text("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh"
  ):
    raise ConfigError(
      "config.json's vision_config differs from Gemma 3's SigLIP (3 channels, layer_norm_eps 1e-6, gelu_pytorch_tanh); maxtext's tower has those"
    )
  return {
    "use_multimodal": True,
    "image_size_for_vit": v.int("image_size"),
    "patch_size_for_vit": v.int("patch_size"),
    "hidden_size_for_vit": v.int("hidden_size"),
    "intermediate_size_for_vit": v.int("intermediate_size"),
    "num_hidden_layers_for_vit": v.int("num_hidden_layers"),
    "num_attention_heads_for_vit": v.int("num_attention_heads"),
    "mm_tokens_per_image": hf.int("mm_tokens_per_image", 256),
    "image_token_id": hf.int("image_token_index", 262144, minimum=0),
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
  rope = _rope_export(c, mla=bool({"mla", "mla_sparse"} & registry.get(c.decoder_block).mixers(c)))
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
  rope = _rope_export(c, mla=True)
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


def _rope_export(c: Config, mla: bool = False) -> dict[str, Any]:
  """rope_parameters of a config.json: default, linear, llama3 or yarn (MLA's yarn: DeepSeek's mscale form or cos/sin scaling)."""
  rope: dict[str, Any] = {"rope_theta": c.rope_max_timescale, "rope_type": "default"}
  if c.rope_type == "llama3.1":
    rope.update(
      rope_type="llama3",
      factor=c.rope_scaling_factor,
      low_freq_factor=c.rope_low_freq_factor,
      high_freq_factor=c.rope_high_freq_factor,
      original_max_position_embeddings=c.rope_original_max_position_embeddings,
    )
  elif c.rope_type == "yarn":
    rope.update(
      rope_type="yarn",
      factor=float(c.rope_factor),
      original_max_position_embeddings=c.original_max_position_embeddings,
      beta_fast=c.beta_fast,
      beta_slow=c.beta_slow,
      truncate=c.rope_truncate,
    )
    if mla and not c.rope_attention_scaling:
      if c.mscale == 0:
        raise ConfigError("yarn with mscale=0 and rope_attention_scaling=false has no Hugging Face equivalent")
      rope.update(mscale=c.mscale, mscale_all_dim=c.mscale)
    elif not c.rope_attention_scaling or (mla and c.mscale != 0):
      raise ConfigError("this yarn setting (rope_attention_scaling, mscale) has no Hugging Face equivalent; export needs yarn's default cos/sin scaling")
  elif c.rope_linear_scaling_factor != 1.0:
    rope.update(rope_type="linear", factor=c.rope_linear_scaling_factor)
  return rope
