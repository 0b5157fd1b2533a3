"""Gemma 4 (text decoder) config.json <-> maxtext keys (maxtext.convert.hf_config and hf_config_export call these for the gemma4 family;
its tensor names are in maxtext.convert.hf_layer_rules)."""

from __future__ import annotations

from typing import Any

from maxtext.convert.hf_fields import HFFields
from maxtext.errors import ConfigError
from maxtext.models import registry

# The run's config, read by attribute (a maxtext.config.MaxTextConfig; not imported: the config's loader reads this module)
Config = Any

MODEL_TYPES = ("gemma4_text", "gemma4")
HF_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "gelu": "gelu_exact", "silu": "silu", "swish": "silu", "relu": "relu"}
TO_HF_ACTIVATIONS = {"gelu": "gelu_pytorch_tanh", "gelu_exact": "gelu", "silu": "silu", "relu": "relu"}
# Gemma4TextConfig's defaults for the fields a config.json may leave out.
TEXT_DEFAULTS = {
  "vocab_size": 262_144,
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "num_hidden_layers": 30,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "rms_norm_eps": 1e-6,
  "sliding_window": 512,
  "tie_word_embeddings": True,
  "vocab_size_per_layer_input": 262_144,
  "hidden_size_per_layer_input": 256,
}
DEFAULT_PERIOD = 6  # Gemma4TextConfig's layer_types without a config.json list: five sliding layers, one full
NOT_BUILT = {  # config.json fields of features maxtext's gemma4 does not build, with the value that means "off"
  "use_bidirectional_attention": None,
  "attention_bias": False,
}


def text_fields(hf: dict[str, Any], source: str) -> HFFields:
  """The decoder's fields: a multimodal gemma4 config's text_config, else the config itself, over Gemma4TextConfig's defaults."""
  if hf.get("model_type") == "gemma4":
    text = HFFields(hf, source).section("text_config").values
    return HFFields({**TEXT_DEFAULTS, **text, "model_type": "gemma4_text"}, source, "text_config.")
  return HFFields({**TEXT_DEFAULTS, **hf}, source)


def _global_overrides(f: HFFields, types: list[str]) -> tuple[int, int]:
  """(global_head_dim, global_num_kv_heads) of the full-attention layers: config.json's per_layer_config (transformers
  5 writes it) or its global_head_dim / num_global_key_value_heads; every full layer must have the same, sliding
  layers none."""
  head_dim, kv = f.int("head_dim"), f.int("num_key_value_heads")
  per_layer = f.values.get("per_layer_config")
  if per_layer is None:
    g_kv = f.int("num_global_key_value_heads", None) if f.flag("attention_k_eq_v", False) else None
    return f.int("global_head_dim", 512), g_kv or kv
  if not isinstance(per_layer, dict):
    raise ConfigError(f"{f.name('per_layer_config')} in {f.source} is not a mapping of layer index to overrides; fix it")
  found: dict[int, dict] = {}
  for key, value in per_layer.items():
    if not str(key).isdigit() or not isinstance(value, dict):
      raise ConfigError(f"{f.name('per_layer_config')} in {f.source} has entry {key!r}; maxtext reads layer indices mapping to head_dim/num_key_value_heads")
    unknown = sorted(set(value) - {"head_dim", "num_key_value_heads"})
    if unknown:
      raise ConfigError(f"{f.name('per_layer_config')}[{key}] overrides {', '.join(unknown)}, which maxtext's gemma4 does not vary per layer")
    found[int(key)] = value
  full = [i for i, t in enumerate(types) if t == "full_attention"]
  if sorted(found) != full or len({tuple(sorted(v.items())) for v in found.values()}) > 1:
    raise ConfigError(
      f"{f.name('per_layer_config')} in {f.source} overrides layers {sorted(found)}, not the same head_dim/num_key_value_heads on every "
      f"full_attention layer {full}; maxtext's gemma4 has one global layer shape: fix per_layer_config"
    )
  first = found[full[0]] if full else {}
  return int(first.get("head_dim", head_dim)), int(first.get("num_key_value_heads", kv))


def _layer_types(f: HFFields, layers: int) -> tuple[list[str], int]:
  """config.json's layer_types and the period they repeat with (sliding layers, then one full); the last layer is
  full, as transformers forces."""
  types = f.texts("layer_types")
  if types is None:
    period = DEFAULT_PERIOD
  else:
    if len(types) != layers:
      raise ConfigError(f"{f.source} lists {len(types)} layer_types for num_hidden_layers={layers}; the two contradict each other, fix one")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
      raise ConfigError(f"{f.source}'s layer_types has unknown type(s) {', '.join(unknown)}; gemma4 has sliding_attention and full_attention")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    period = full[0] + 1
  expected = ["full_attention" if (i + 1) % period == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]
  if types is not None and types != expected:
    raise ConfigError(
      f"{f.source}'s layer_types are not {period - 1} sliding_attention layers then one full_attention layer, repeated (the last layer full); "
      "maxtext's gemma4 has that pattern: fix layer_types"
    )
  return expected, period


def _experts(f: HFFields) -> dict[str, Any]:
  """The MoE block's keys (enable_moe_block): routed experts beside each layer's dense MLP, MaxText's one shared expert;
  transformers' router always renormalises the chosen experts' weights."""
  if not f.flag("enable_moe_block", False):
    return {"num_experts": 1}
  missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if f.values.get(k) is None]
  if missing:
    raise ConfigError(f"{f.source} has {f.name('enable_moe_block')}=true without {', '.join(missing)}; the MoE block needs all three: add them")
  experts, k = f.int("num_experts", minimum=2), f.int("top_k_experts")
  if k > experts:
    raise ConfigError(f"{f.source} has top_k_experts={k} for num_experts={experts}; a token cannot choose more experts than there are: fix one")
  return {"num_experts": experts, "num_experts_per_tok": k, "base_moe_mlp_dim": f.int("moe_intermediate_size"), "shared_experts": 1, "norm_topk_prob": True}


def _rope(f: HFFields) -> dict[str, Any]:
  """Per layer type rope_parameters: default rope on the sliding layers, default or proportional on the full layers."""
  params = f.section("rope_parameters")
  out: dict[str, Any] = {}
  for layer_type, prefix in (("sliding_attention", "local"), ("full_attention", "global")):
    p = params.section(layer_type)
    kind = p.text("rope_type", "default")
    if kind not in ("default", "proportional"):
      raise ConfigError(f"{p.name('rope_type')} '{kind}' in {f.source} is not supported for gemma4; supported: default, proportional")
    if p.number("factor", 1.0, positive=True) != 1.0:
      raise ConfigError(f"{p.name('factor')} in {f.source} scales gemma4's rope; maxtext's gemma4 rope has no factor: remove it")
    theta = p.number("rope_theta", 10_000.0 if layer_type == "sliding_attention" else 1_000_000.0, positive=True)
    out[f"{prefix}_rope_max_timescale"] = theta
    out[f"{prefix}_rope_proportion"] = p.number("partial_rotary_factor", 1.0, positive=True) if kind == "proportional" else 1.0
  out["rope_max_timescale"] = out["global_rope_max_timescale"]
  return out


def overrides(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
  """maxtext keys of a gemma4_text (or multimodal gemma4) config.json; contradictions and features maxtext does not
  build are one-line ConfigErrors naming the field."""
  f = text_fields(hf, source)
  for key, off in NOT_BUILT.items():
    if key == "use_bidirectional_attention" and f.values.get(key) == "vision":
      continue  # only image tokens attend both ways (the multimodal model's mask); text attends causally, as here
    if f.values.get(key, off) not in (off, False, None):
      raise ConfigError(f"{f.name(key)}={f.values[key]!r} in {source}: maxtext's gemma4 does not build that feature; it loads {key}={off!r} models only")
  heads, kv, layers = f.int("num_attention_heads"), f.int("num_key_value_heads"), f.int("num_hidden_layers")
  if heads % kv:
    raise ConfigError(f"{source} has num_attention_heads={heads}, not a multiple of num_key_value_heads={kv}; the two contradict each other")
  act = f.text("hidden_activation")
  if act not in HF_ACTIVATIONS:
    raise ConfigError(f"activation '{act}' in {source} is not supported; supported: {', '.join(HF_ACTIVATIONS)}")
  types, period = _layer_types(f, layers)
  shared = f.int("num_kv_shared_layers", 0, minimum=0)
  if shared >= layers:
    raise ConfigError(f"{source} has num_kv_shared_layers={shared} for num_hidden_layers={layers}, which leaves no layer to compute keys and values")
  unshared = set(types[: layers - shared])
  if shared and unshared != set(types):
    raise ConfigError(
      f"{source}'s num_kv_shared_layers={shared} shares every {(set(types) - unshared).pop()} layer, so none computes the keys and values they reuse; "
      "lower num_kv_shared_layers"
    )
  global_head_dim, global_kv = _global_overrides(f, types)
  if heads % global_kv:
    raise ConfigError(f"{source}'s full_attention layers have {global_kv} key/value heads, not a divisor of num_attention_heads={heads}")
  ple = f.int("hidden_size_per_layer_input", 0, minimum=0)
  out: dict[str, Any] = {
    "decoder_block": "gemma4",
    "base_emb_dim": f.int("hidden_size"),
    "base_num_query_heads": heads,
    "base_num_kv_heads": kv,
    "head_dim": f.int("head_dim"),
    "global_head_dim": global_head_dim,
    "global_num_kv_heads": global_kv,
    "share_kv_projections": f.flag("attention_k_eq_v", False),
    "v_norm_with_scale": False,
    "base_mlp_dim": f.int("intermediate_size"),
    "base_num_decoder_layers": layers,
    "inhomogeneous_layer_cycle_interval": period,
    "vocab_size": f.int("vocab_size"),
    "normalization_layer_epsilon": f.number("rms_norm_eps", positive=True),
    "mlp_activations": [HF_ACTIVATIONS[act], "linear"],
    "logits_via_embedding": f.flag("tie_word_embeddings", True),
    "normalize_embedding_logits": False,
    "sliding_window_size": f.int("sliding_window") if "sliding_attention" in types else 0,
    "final_logits_soft_cap": f.number("final_logit_softcapping", None, positive=True),
    "hidden_size_per_layer_input": ple,
    "vocab_size_per_layer_input": f.int("vocab_size_per_layer_input") if ple else 0,
    "num_kv_shared_layers": shared,
    "use_double_wide_mlp": f.flag("use_double_wide_mlp", False) and shared > 0,
    "global_parameter_scale": 1,
    **_experts(f),
    **_rope(f),
  }
  dt = f.text("dtype", None) or f.text("torch_dtype", None) or hf.get("dtype") or hf.get("torch_dtype")
  if dt in ("float32", "bfloat16", "float16"):
    out["dtype"] = dt
  return out


def export(c: Config) -> dict[str, Any]:
  """A Gemma4TextConfig config.json for a gemma4 maxtext config (transformers loads it)."""
  if c.num_experts > 1 and (c.routed_score_func not in ("", "softmax") or c.routed_bias or c.routed_scaling_factor != 1.0 or c.n_routing_groups > 0):
    raise ConfigError(
      "Gemma4's router is a plain softmax top-k; export a gemma4 model with experts with routed_score_func=softmax, routed_bias=false, "
      "routed_scaling_factor=1 and n_routing_groups=0"
    )
  if c.v_norm_with_scale:
    raise ConfigError("Gemma4's value norm has no scale; export a gemma4 model with v_norm_with_scale=false")
  if c.mlp_activations[-1] != "linear" or len(c.mlp_activations) != 2 or c.mlp_activations[0] not in TO_HF_ACTIVATIONS:
    raise ConfigError(f"mlp_activations {c.mlp_activations} have no Hugging Face equivalent; use [gelu, linear]")
  if c.global_num_kv_heads and c.global_num_kv_heads != c.num_kv_heads and not c.share_kv_projections:
    raise ConfigError("Gemma4 changes the global layers' kv heads only with attention_k_eq_v; set share_kv_projections=true or global_num_kv_heads=0")
  kinds = registry.get(c.decoder_block).kinds(c)
  types = ["full_attention" if k.variant == "global" else "sliding_attention" for k in kinds]
  global_rope = {"rope_type": "proportional", "partial_rotary_factor": c.global_rope_proportion, "rope_theta": _theta(c, c.global_rope_max_timescale)}
  local_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _theta(c, c.local_rope_max_timescale)}
  if c.local_rope_proportion != 1.0:
    local_rope.update(rope_type="proportional", partial_rotary_factor=c.local_rope_proportion)
  return {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "hidden_size": c.emb_dim,
    "num_attention_heads": c.num_query_heads,
    "num_key_value_heads": c.num_kv_heads,
    "head_dim": c.head_dim,
    "global_head_dim": c.global_head_dim or c.head_dim,
    "num_global_key_value_heads": c.global_num_kv_heads or c.num_kv_heads,
    "attention_k_eq_v": c.share_kv_projections,
    "intermediate_size": c.mlp_dim,
    "num_hidden_layers": c.num_decoder_layers,
    "vocab_size": c.vocab_size,
    "rms_norm_eps": c.normalization_layer_epsilon,
    "hidden_activation": TO_HF_ACTIVATIONS[c.mlp_activations[0]],
    "tie_word_embeddings": c.logits_via_embedding,
    "rope_parameters": {"sliding_attention": local_rope, "full_attention": global_rope},
    "sliding_window": c.sliding_window_size or 512,
    "layer_types": types,
    "final_logit_softcapping": c.final_logits_soft_cap,
    "hidden_size_per_layer_input": c.hidden_size_per_layer_input,
    "vocab_size_per_layer_input": c.vocab_size_per_layer_input or c.vocab_size,
    "num_kv_shared_layers": c.num_kv_shared_layers,
    "use_double_wide_mlp": c.use_double_wide_mlp,
    "enable_moe_block": c.num_experts > 1,
    **({"num_experts": c.num_experts, "top_k_experts": c.num_experts_per_tok, "moe_intermediate_size": c.moe_mlp_dim} if c.num_experts > 1 else {}),
    "attention_bias": False,
    "max_position_embeddings": max(c.max_target_length, 8192),
    "dtype": c.weight_dtype,
  }


def _theta(c: Config, value: float) -> float:
  return value if value > 0 else c.rope_max_timescale
