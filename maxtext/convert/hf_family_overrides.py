"""The family-specific keys of a Hugging Face config.json read as maxtext keys: experts (Qwen3-MoE, DeepSeek, gpt-oss),
DeepSeek's indexer, Qwen3-Next's hybrid layers, Llama 4's pattern and Gemma 3's vision tower."""

from __future__ import annotations

import math
from typing import Any

from maxtext.convert.hf_fields import HFFields
from maxtext.convert.hf_model_types import (
  GPT_OSS_SWIGLU_ALPHA,
)
from maxtext.errors import ConfigError, shorten


def expert_count(hf: HFFields, *keys: str) -> int:
  """The expert count, from the first of keys the config.json sets (families name it differently)."""
  for key in keys:
    if hf.has(key):
      return hf.int(key)
  return hf.int(keys[0])  # none set: the error names the family's own key


def moe_overrides(hf: HFFields, model_type: str) -> dict[str, Any]:
  """Expert keys of qwen3_moe and deepseek_v3 config.json files."""
  if model_type == "qwen3_moe":
    if hf.int("decoder_sparse_step", 1) != 1 or hf.values.get("mlp_only_layers"):
      raise ConfigError("qwen3_moe config.json with decoder_sparse_step != 1 or mlp_only_layers is not supported; every layer must be MoE")
    return {
      "num_experts": expert_count(hf, "num_experts", "num_local_experts"),
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
    "num_experts": expert_count(hf, "n_routed_experts", "num_local_experts"),
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


def gpt_oss_overrides(hf: HFFields) -> dict[str, Any]:
  """Expert, bias, sink and activation keys of a gpt_oss config.json."""
  alpha = hf.number("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)
  if alpha != GPT_OSS_SWIGLU_ALPHA:
    raise ConfigError(f"gpt_oss config.json has swiglu_alpha={alpha}; maxtext's clamped SwiGLU uses {GPT_OSS_SWIGLU_ALPHA}")
  if not hf.flag("attention_bias", True):
    raise ConfigError("gpt_oss config.json with attention_bias=false is not supported; gpt-oss checkpoints have q/k/v/o biases")
  return {
    "num_experts": expert_count(hf, "num_local_experts", "num_experts"),
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


def qwen3_next_overrides(hf: HFFields, family: str = "qwen3_next") -> dict[str, Any]:
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


def llama4_overrides(hf: HFFields) -> dict[str, Any]:
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


SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224, "patch_size": 16}


def gemma3_vision_overrides(hf: HFFields) -> dict[str, Any]:
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
