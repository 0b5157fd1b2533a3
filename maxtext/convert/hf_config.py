"""Hugging Face config.json -> maxtext config keys (the reverse: maxtext.convert.hf_config_export)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from maxtext.convert import hf_deepseek_v4_config, hf_gemma4, hf_qwen3_vl, safetensors_io
from maxtext.convert.hf_family_overrides import expert_count, gemma3_vision_overrides, gpt_oss_overrides, llama4_overrides, moe_overrides, qwen3_next_overrides
from maxtext.convert.hf_fields import HFFields
from maxtext.convert.hf_model_types import (
  BIASED_ATTENTION_TYPES,
  DEEPSEEK_TYPES,
  GEMMA3_TEXT_DEFAULTS,
  HF_ACTIVATIONS,
  HYBRID_TYPES,
  QWEN3_5_MULTIMODAL,
  UNBIASED_ATTENTION_TYPES,
  WINDOWED_TYPES,
)
from maxtext.convert.hf_rope import rope_overrides
from maxtext.errors import ConfigError
from maxtext.models import registry


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
    experts = expert_count(hf, "n_routed_experts", "num_local_experts")
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
    **rope_overrides(f),
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
    out.update(gpt_oss_overrides(f))
  if model_type in ("qwen3_moe", *DEEPSEEK_TYPES):
    out.update(moe_overrides(f, model_type))
  if model_type in HYBRID_TYPES:
    out.update(qwen3_next_overrides(f, family.name))
  if model_type == "llama4_text":
    out.update(llama4_overrides(f))
  dt = f.text("dtype", None) or f.text("torch_dtype", None)
  if dt in ("float32", "bfloat16", "float16"):
    out["dtype"] = dt
  if hf.get("model_type") == "gemma3" and "vision_config" in hf:
    out.update(gemma3_vision_overrides(HFFields(hf, source)))
  if hf.get("model_type") in hf_qwen3_vl.MODEL_TYPES:
    out.update(hf_qwen3_vl.vision_overrides(HFFields(hf, source)))
  if hf.get("model_type") == "llama4" and "vision_config" in hf:
    from maxtext.vision.llama4_hf_config import llama4_vision_keys

    out.update(llama4_vision_keys(HFFields(hf, source)))
  return out
