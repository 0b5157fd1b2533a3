"""Hugging Face <-> maxtext weights of Gemma 3's vision tower and projector, both directions, bit-exact (transposes,
reshapes and the stacking of blocks only; no arithmetic).

Hugging Face names are relative to a prefix: transformers 5's Gemma3ForConditionalGeneration state dict holds the
tower at `model.vision_tower.` and the projector at `model.multi_modal_projector.` (the published safetensors files
at `vision_tower.vision_model.` and `multi_modal_projector.`). Gemma 3 has no SigLIP pooling head (vision_use_head). Our side is the flat {"a/b/c": array} of a module's
parameters (`flat_params`), which `load_params` puts back into a module.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext.vision.gemma3_projector import Gemma3ProjectorSpec
from maxtext.vision.siglip import SiglipSpec

HF_TOWER_PREFIX = "model.vision_tower."
HF_PROJECTOR_PREFIX = "model.multi_modal_projector."

# our block path -> (HF layer path, kind); kinds: q/k/v/o attention projections, dense (torch Linear), plain
_BLOCK = {
  "pre_attention_norm/scale": ("layer_norm1.weight", "plain"),
  "pre_attention_norm/bias": ("layer_norm1.bias", "plain"),
  "pre_mlp_norm/scale": ("layer_norm2.weight", "plain"),
  "pre_mlp_norm/bias": ("layer_norm2.bias", "plain"),
  "attention/query/kernel": ("self_attn.q_proj.weight", "in_proj"),
  "attention/query/bias": ("self_attn.q_proj.bias", "head_bias"),
  "attention/key/kernel": ("self_attn.k_proj.weight", "in_proj"),
  "attention/key/bias": ("self_attn.k_proj.bias", "head_bias"),
  "attention/value/kernel": ("self_attn.v_proj.weight", "in_proj"),
  "attention/value/bias": ("self_attn.v_proj.bias", "head_bias"),
  "attention/out/kernel": ("self_attn.out_proj.weight", "out_proj"),
  "attention/out/bias": ("self_attn.out_proj.bias", "plain"),
  "mlp/wi/kernel": ("mlp.fc1.weight", "dense"),
  "mlp/wi/bias": ("mlp.fc1.bias", "plain"),
  "mlp/wo/kernel": ("mlp.fc2.weight", "dense"),
  "mlp/wo/bias": ("mlp.fc2.bias", "plain"),
}


def _to_ours(w: np.ndarray, kind: str, spec: SiglipSpec) -> np.ndarray:
  h, d = spec.num_heads, spec.head_dim
  if kind == "in_proj":  # torch [H*D, E] -> [E, H, D]
    return w.T.reshape(w.shape[1], h, d)
  if kind == "out_proj":  # torch [E, H*D] -> [H, D, E]
    return w.T.reshape(h, d, w.shape[0])
  if kind == "head_bias":
    return w.reshape(h, d)
  if kind == "dense":
    return w.T
  return w


def _to_hf(w: np.ndarray, kind: str) -> np.ndarray:
  if kind == "in_proj":
    return w.reshape(w.shape[0], -1).T
  if kind == "out_proj":
    return w.reshape(-1, w.shape[-1]).T
  if kind == "head_bias":
    return w.reshape(-1)
  if kind == "dense":
    return w.T
  return w


def siglip_from_hf(hf: Mapping[str, np.ndarray], spec: SiglipSpec, prefix: str = HF_TOWER_PREFIX) -> dict[str, np.ndarray]:
  """HF SiglipVisionTransformer weights (names after `prefix`) -> SiglipVisionTower's flat parameters."""
  emb, enc = prefix + "embeddings.", prefix + "encoder.layers."
  out = {
    "patch_embed/kernel": np.asarray(hf[emb + "patch_embedding.weight"]).transpose(2, 3, 1, 0),  # [E, C, p, p] -> [p, p, C, E]
    "patch_embed/bias": np.asarray(hf[emb + "patch_embedding.bias"]),
    "position_embed": np.asarray(hf[emb + "position_embedding.weight"]),
    "post_norm/scale": np.asarray(hf[prefix + "post_layernorm.weight"]),
    "post_norm/bias": np.asarray(hf[prefix + "post_layernorm.bias"]),
  }
  for ours, (theirs, kind) in _BLOCK.items():
    out["blocks/" + ours] = np.stack([_to_ours(np.asarray(hf[f"{enc}{i}.{theirs}"]), kind, spec) for i in range(spec.num_layers)])
  return out


def siglip_to_hf(params: Mapping[str, np.ndarray], spec: SiglipSpec, prefix: str = HF_TOWER_PREFIX) -> dict[str, np.ndarray]:
  """SiglipVisionTower's flat parameters -> HF SiglipVisionTransformer weights named with `prefix`."""
  emb, enc = prefix + "embeddings.", prefix + "encoder.layers."
  out = {
    emb + "patch_embedding.weight": np.asarray(params["patch_embed/kernel"]).transpose(3, 2, 0, 1),
    emb + "patch_embedding.bias": np.asarray(params["patch_embed/bias"]),
    emb + "position_embedding.weight": np.asarray(params["position_embed"]),
    prefix + "post_layernorm.weight": np.asarray(params["post_norm/scale"]),
    prefix + "post_layernorm.bias": np.asarray(params["post_norm/bias"]),
  }
  for ours, (theirs, kind) in _BLOCK.items():
    stacked = np.asarray(params["blocks/" + ours])
    for i in range(spec.num_layers):
      out[f"{enc}{i}.{theirs}"] = _to_hf(stacked[i], kind)
  return out


def projector_from_hf(hf: Mapping[str, np.ndarray], spec: Gemma3ProjectorSpec, prefix: str = HF_PROJECTOR_PREFIX) -> dict[str, np.ndarray]:
  """HF Gemma3MultiModalProjector weights -> Gemma3Projector's flat parameters (the projection is stored [E_v, E_text] on both sides)."""
  del spec  # the layouts agree; the spec keeps the signature the same as the tower's
  return {"norm/scale": np.asarray(hf[prefix + "mm_soft_emb_norm.weight"]), "projection/kernel": np.asarray(hf[prefix + "mm_input_projection_weight"])}


def projector_to_hf(params: Mapping[str, np.ndarray], spec: Gemma3ProjectorSpec, prefix: str = HF_PROJECTOR_PREFIX) -> dict[str, np.ndarray]:
  del spec
  return {prefix + "mm_soft_emb_norm.weight": np.asarray(params["norm/scale"]), prefix + "mm_input_projection_weight": np.asarray(params["projection/kernel"])}


def flat_params(module: nnx.Module) -> dict[str, np.ndarray]:
  """A module's parameters as {"a/b/c": numpy array}."""
  return {"/".join(str(k) for k in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def load_params(module: nnx.Module, params: Mapping[str, np.ndarray]) -> None:
  """Set every parameter of module from params (names and shapes as flat_params; cast to each parameter's dtype).

  module may be abstract (nnx.eval_shape): the checkpoint then supplies every value and no random init runs.
  """
  names = set()
  for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
    name = "/".join(str(k) for k in path)
    names.add(name)
    if name not in params:
      raise ValueError(f"no value for parameter {name}")
    current, value = variable.get_value(), np.asarray(params[name])
    if value.shape != tuple(current.shape):
      raise ValueError(f"{name}: shape {value.shape}, the module has {tuple(current.shape)}")
    variable.set_value(jnp.asarray(value, current.dtype))
  extra = set(params) - names
  if extra:
    raise ValueError(f"parameters the module does not have: {sorted(extra)}")


def _linear(hf: Mapping[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
  return {"kernel": np.asarray(hf[name + ".weight"]).T, "bias": np.asarray(hf[name + ".bias"])}


def _norm(hf: Mapping[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
  return {"scale": np.asarray(hf[name + ".weight"]), "bias": np.asarray(hf[name + ".bias"])}


def _merger_from_hf(hf: Mapping[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
  parts = {"norm": _norm(hf, name + ".norm"), "wa": _linear(hf, name + ".linear_fc1"), "wb": _linear(hf, name + ".linear_fc2")}
  return {f"{module}/{leaf}": value for module, leaves in parts.items() for leaf, value in leaves.items()}


def qwen3_vl_from_hf(hf: Mapping[str, np.ndarray], spec, prefix: str = "model.visual.") -> dict[str, np.ndarray]:
  """HF Qwen3VLVisionModel weights (names after `prefix`) -> Qwen3VLVisionTower's flat parameters (spec: Qwen3VLVisionSpec)."""
  e, h, d = spec.emb_dim, spec.num_heads, spec.head_dim
  out = {
    "patch_embed/kernel": np.asarray(hf[prefix + "patch_embed.proj.weight"]).transpose(1, 2, 3, 4, 0),  # [E, C, T, p, p] -> [C, T, p, p, E]
    "patch_embed/bias": np.asarray(hf[prefix + "patch_embed.proj.bias"]),
    "position_embed": np.asarray(hf[prefix + "pos_embed.weight"]),
    **{"merger/" + k: v for k, v in _merger_from_hf(hf, prefix + "merger").items()},
  }

  def block(i: int) -> dict[str, np.ndarray]:
    b = f"{prefix}blocks.{i}."
    qkv_w, qkv_b = np.asarray(hf[b + "attn.qkv.weight"]), np.asarray(hf[b + "attn.qkv.bias"])
    return {
      "pre_attention_norm/scale": np.asarray(hf[b + "norm1.weight"]),
      "pre_attention_norm/bias": np.asarray(hf[b + "norm1.bias"]),
      "pre_mlp_norm/scale": np.asarray(hf[b + "norm2.weight"]),
      "pre_mlp_norm/bias": np.asarray(hf[b + "norm2.bias"]),
      "attention/qkv/kernel": qkv_w.T.reshape(e, 3, h, d),
      "attention/qkv/bias": qkv_b.reshape(3, h, d),
      "attention/out/kernel": np.asarray(hf[b + "attn.proj.weight"]).T.reshape(h, d, e),
      "attention/out/bias": np.asarray(hf[b + "attn.proj.bias"]),
      **{f"{ours}/{leaf}": v for ours, theirs in (("wi", "mlp.linear_fc1"), ("wo", "mlp.linear_fc2")) for leaf, v in _linear(hf, b + theirs).items()},
    }

  blocks = [block(i) for i in range(spec.num_layers)]
  out.update({"blocks/" + k: np.stack([b[k] for b in blocks]) for k in blocks[0]})
  mergers = [_merger_from_hf(hf, f"{prefix}deepstack_merger_list.{j}") for j in range(len(spec.deepstack_indexes))]
  if mergers:
    out.update({"deepstack_mergers/" + k: np.stack([m[k] for m in mergers]) for k in mergers[0]})
  return out


def _merger_to_hf(params: Mapping[str, np.ndarray], ours: str, name: str, index: int | None = None) -> dict[str, np.ndarray]:
  def get(leaf: str) -> np.ndarray:
    value = np.asarray(params[f"{ours}/{leaf}"])
    return value if index is None else value[index]

  return {
    name + ".norm.weight": get("norm/scale"),
    name + ".norm.bias": get("norm/bias"),
    name + ".linear_fc1.weight": get("wa/kernel").T,
    name + ".linear_fc1.bias": get("wa/bias"),
    name + ".linear_fc2.weight": get("wb/kernel").T,
    name + ".linear_fc2.bias": get("wb/bias"),
  }


def qwen3_vl_to_hf(params: Mapping[str, np.ndarray], spec, prefix: str = "model.visual.") -> dict[str, np.ndarray]:
  """Qwen3VLVisionTower's flat parameters -> HF Qwen3VLVisionModel weights named with `prefix` (inverse of qwen3_vl_from_hf)."""
  out = {
    prefix + "patch_embed.proj.weight": np.asarray(params["patch_embed/kernel"]).transpose(4, 0, 1, 2, 3),
    prefix + "patch_embed.proj.bias": np.asarray(params["patch_embed/bias"]),
    prefix + "pos_embed.weight": np.asarray(params["position_embed"]),
    **_merger_to_hf(params, "merger", prefix + "merger"),
  }
  for j in range(len(spec.deepstack_indexes)):
    out.update(_merger_to_hf(params, "deepstack_mergers", f"{prefix}deepstack_merger_list.{j}", j))
  for i in range(spec.num_layers):
    b = f"{prefix}blocks.{i}."

    def get(name: str, i: int = i) -> np.ndarray:
      return np.asarray(params["blocks/" + name])[i]

    out.update(
      {
        b + "norm1.weight": get("pre_attention_norm/scale"),
        b + "norm1.bias": get("pre_attention_norm/bias"),
        b + "norm2.weight": get("pre_mlp_norm/scale"),
        b + "norm2.bias": get("pre_mlp_norm/bias"),
        b + "attn.qkv.weight": get("attention/qkv/kernel").reshape(spec.emb_dim, -1).T,
        b + "attn.qkv.bias": get("attention/qkv/bias").reshape(-1),
        b + "attn.proj.weight": get("attention/out/kernel").reshape(-1, spec.emb_dim).T,
        b + "attn.proj.bias": get("attention/out/bias"),
        b + "mlp.linear_fc1.weight": get("wi/kernel").T,
        b + "mlp.linear_fc1.bias": get("wi/bias"),
        b + "mlp.linear_fc2.weight": get("wo/kernel").T,
        b + "mlp.linear_fc2.bias": get("wo/bias"),
      }
    )
  return out


# Gemma 3's vision component inside a whole Gemma3ForConditionalGeneration checkpoint. The tower's prefix differs by
# writer: transformers 5's state dict, the published hub files, transformers 5's save_pretrained (what export writes).
GEMMA3_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.vision_model.", "vision_tower.")
GEMMA3_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
SAVED_TOWER_PREFIX, SAVED_PROJECTOR_PREFIX = "vision_tower.", "multi_modal_projector."
OURS_TOWER, OURS_PROJECTOR = "vision/tower/", "vision/projector/"  # the Transformer's vision encoder (maxtext.vision.gemma3_encoder)


def _prefix(tensors: Mapping[str, np.ndarray], prefixes: tuple[str, ...], probe: str) -> str | None:
  return next((p for p in prefixes if p + probe in tensors), None)


def gemma3_vision_from_hf(tensors: Mapping[str, np.ndarray], spec) -> tuple[dict[str, np.ndarray], set[str]]:
  """A Gemma3ForConditionalGeneration checkpoint's tower and projector -> (the Transformer's flat vision parameters,
  the checkpoint names consumed). spec: Gemma3VisionSpec. Missing or misshapen tensors are ValueErrors naming them."""
  tower_prefix = _prefix(tensors, GEMMA3_TOWER_PREFIXES, "embeddings.patch_embedding.weight")
  projector_prefix = _prefix(tensors, GEMMA3_PROJECTOR_PREFIXES, "mm_input_projection_weight")
  if tower_prefix is None or projector_prefix is None:
    raise ValueError("the checkpoint has no Gemma 3 vision tower and projector (vision_tower.*, multi_modal_projector.*)")
  used = set(siglip_to_hf_names(spec.tower, tower_prefix)) | {projector_prefix + "mm_soft_emb_norm.weight", projector_prefix + "mm_input_projection_weight"}
  missing = sorted(used - set(tensors))
  if missing:
    raise ValueError(f"the checkpoint is missing tensor '{missing[0]}' of the vision tower (num_hidden_layers_for_vit={spec.tower.num_layers})")
  try:
    tower = siglip_from_hf(tensors, spec.tower, tower_prefix)
  except ValueError as e:
    raise ValueError(f"the vision tower's tensors do not fit the *_for_vit sizes ({e})") from None
  out = {OURS_TOWER + k: v for k, v in tower.items()}
  out |= {OURS_PROJECTOR + k: v for k, v in projector_from_hf(tensors, spec.projector, projector_prefix).items()}
  for name, shape in _expected_shapes(spec).items():
    if tuple(out[name].shape) != shape:
      raise ValueError(f"the vision tensor for {name} has shape {tuple(out[name].shape)}; the *_for_vit keys and mm_tokens_per_image give {shape}")
  return out, used


def siglip_to_hf_names(spec: SiglipSpec, prefix: str) -> list[str]:
  emb, enc = prefix + "embeddings.", prefix + "encoder.layers."
  fixed = [
    emb + "patch_embedding.weight",
    emb + "patch_embedding.bias",
    emb + "position_embedding.weight",
    prefix + "post_layernorm.weight",
    prefix + "post_layernorm.bias",
  ]
  return fixed + [f"{enc}{i}.{theirs}" for i in range(spec.num_layers) for theirs, _ in _BLOCK.values()]


def _expected_shapes(spec) -> dict[str, tuple[int, ...]]:
  t, p = spec.tower, spec.projector
  return {
    OURS_TOWER + "patch_embed/kernel": (t.patch_size, t.patch_size, t.num_channels, t.emb_dim),
    OURS_TOWER + "position_embed": (t.num_patches, t.emb_dim),
    OURS_TOWER + "blocks/mlp/wi/kernel": (t.num_layers, t.emb_dim, t.mlp_dim),
    OURS_PROJECTOR + "projection/kernel": (p.vision_dim, p.text_dim),
  }


def gemma3_vision_to_hf(params: Mapping[str, np.ndarray], spec) -> dict[str, np.ndarray]:
  """The Transformer's flat vision parameters -> tensors named as transformers 5's save_pretrained writes them."""
  tower = {k[len(OURS_TOWER) :]: v for k, v in params.items() if k.startswith(OURS_TOWER)}
  projector = {k[len(OURS_PROJECTOR) :]: v for k, v in params.items() if k.startswith(OURS_PROJECTOR)}
  return siglip_to_hf(tower, spec.tower, SAVED_TOWER_PREFIX) | projector_to_hf(projector, spec.projector, SAVED_PROJECTOR_PREFIX)
