"""Hugging Face <-> maxtext weights of Llama 4's vision component (Llama4ForConditionalGeneration's vision_model and
multi_modal_projector), both directions, bit-exact: transposes, reshapes and the stacking of blocks only.

Checkpoint names: transformers 5's save_pretrained (and the published files) hold `vision_model.*` and
`multi_modal_projector.*`, its in-memory state dict `model.vision_model.*` and `model.multi_modal_projector.*`. Ours:
`vision/tower/...` and `vision/projector/...` of the Transformer (maxtext.vision.llama4_vision).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from maxtext.vision.convert import _to_hf, _to_ours
from maxtext.vision.llama4_vision import Llama4VisionSpec

TOWER_PREFIXES = ("vision_model.", "model.vision_model.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
SAVED_TOWER_PREFIX, SAVED_PROJECTOR_PREFIX = TOWER_PREFIXES[0], PROJECTOR_PREFIXES[0]
OURS_TOWER, OURS_PROJECTOR = "vision/tower/", "vision/projector/"

# our block path -> (HF layer path, kind: maxtext.vision.convert's in_proj/out_proj/head_bias/dense/plain)
_BLOCK = {
  "pre_attention_norm/scale": ("input_layernorm.weight", "plain"),
  "pre_attention_norm/bias": ("input_layernorm.bias", "plain"),
  "pre_mlp_norm/scale": ("post_attention_layernorm.weight", "plain"),
  "pre_mlp_norm/bias": ("post_attention_layernorm.bias", "plain"),
  "attention/query/kernel": ("self_attn.q_proj.weight", "in_proj"),
  "attention/query/bias": ("self_attn.q_proj.bias", "head_bias"),
  "attention/key/kernel": ("self_attn.k_proj.weight", "in_proj"),
  "attention/key/bias": ("self_attn.k_proj.bias", "head_bias"),
  "attention/value/kernel": ("self_attn.v_proj.weight", "in_proj"),
  "attention/value/bias": ("self_attn.v_proj.bias", "head_bias"),
  "attention/out/kernel": ("self_attn.o_proj.weight", "out_proj"),
  "attention/out/bias": ("self_attn.o_proj.bias", "plain"),
  "mlp/wi/kernel": ("mlp.fc1.weight", "dense"),
  "mlp/wi/bias": ("mlp.fc1.bias", "plain"),
  "mlp/wo/kernel": ("mlp.fc2.weight", "dense"),
  "mlp/wo/bias": ("mlp.fc2.bias", "plain"),
}
# our tower path outside the blocks -> (HF name after the prefix, kind); patch: torch [E, C p p] <-> [C, p, p, E]
_TOWER = {
  "patch_embed/kernel": ("patch_embedding.linear.weight", "patch"),
  "class_embed": ("class_embedding", "plain"),
  "position_embed": ("positional_embedding_vlm", "plain"),
  "pre_norm/scale": ("layernorm_pre.weight", "plain"),
  "pre_norm/bias": ("layernorm_pre.bias", "plain"),
  "post_norm/scale": ("layernorm_post.weight", "plain"),
  "post_norm/bias": ("layernorm_post.bias", "plain"),
  "adapter/wa/kernel": ("vision_adapter.mlp.fc1.weight", "dense"),
  "adapter/wb/kernel": ("vision_adapter.mlp.fc2.weight", "dense"),
}
_PROJECTION = "linear_1.weight"


def hf_names(spec: Llama4VisionSpec, tower: str = SAVED_TOWER_PREFIX, projector: str = SAVED_PROJECTOR_PREFIX) -> list[str]:
  """Every checkpoint name of the component."""
  blocks = [f"{tower}model.layers.{i}.{theirs}" for i in range(spec.num_layers) for theirs, _ in _BLOCK.values()]
  return [tower + theirs for theirs, _ in _TOWER.values()] + blocks + [projector + _PROJECTION]


def _prefix(tensors: Mapping[str, np.ndarray], prefixes: tuple[str, ...], probe: str) -> str | None:
  return next((p for p in prefixes if p + probe in tensors), None)


def _patch_to_ours(w: np.ndarray, spec: Llama4VisionSpec) -> np.ndarray:
  p, c = spec.patch_size, spec.num_channels
  return w.T.reshape(c, p, p, w.shape[0])


def llama4_vision_from_hf(tensors: Mapping[str, np.ndarray], spec: Llama4VisionSpec) -> tuple[dict[str, np.ndarray], set[str]]:
  """A Llama4ForConditionalGeneration checkpoint's vision model and projector -> (the Transformer's flat vision
  parameters, the names consumed). Missing tensors or sizes the spec does not give are ValueErrors naming them."""
  tower = _prefix(tensors, TOWER_PREFIXES, _TOWER["class_embed"][0])
  projector = _prefix(tensors, PROJECTOR_PREFIXES, _PROJECTION)
  if tower is None or projector is None:
    raise ValueError("the checkpoint has no Llama 4 vision model and projector (vision_model.*, multi_modal_projector.*)")
  used = set(hf_names(spec, tower, projector))
  missing = sorted(used - set(tensors))
  if missing:
    raise ValueError(f"the checkpoint is missing tensor '{missing[0]}' of the vision model (num_hidden_layers_for_vit={spec.num_layers})")
  out: dict[str, np.ndarray] = {}
  try:
    for ours, (theirs, kind) in _TOWER.items():
      w = np.asarray(tensors[tower + theirs])
      out[OURS_TOWER + ours] = _patch_to_ours(w, spec) if kind == "patch" else _to_ours(w, kind, spec)
    for ours, (theirs, kind) in _BLOCK.items():
      out[OURS_TOWER + "blocks/" + ours] = np.stack(
        [_to_ours(np.asarray(tensors[f"{tower}model.layers.{i}.{theirs}"]), kind, spec) for i in range(spec.num_layers)]
      )
  except ValueError as e:
    raise ValueError(f"the vision model's tensors do not fit the *_for_vit sizes ({e})") from None
  out[OURS_PROJECTOR + "projection/kernel"] = np.asarray(tensors[projector + _PROJECTION]).T
  for name, shape in expected_shapes(spec).items():
    if tuple(out[name].shape) != shape:
      raise ValueError(f"the vision tensor for {name} has shape {tuple(out[name].shape)}; the llama4 *_for_vit keys give {shape}")
  return out, used


def expected_shapes(spec: Llama4VisionSpec) -> dict[str, tuple[int, ...]]:
  s = spec
  return {
    OURS_TOWER + "patch_embed/kernel": (s.num_channels, s.patch_size, s.patch_size, s.emb_dim),
    OURS_TOWER + "position_embed": (s.num_patches + 1, s.emb_dim),
    OURS_TOWER + "blocks/mlp/wi/kernel": (s.num_layers, s.emb_dim, s.mlp_dim),
    OURS_TOWER + "adapter/wa/kernel": (s.shuffled_dim, s.adapter_dim),
    OURS_TOWER + "adapter/wb/kernel": (s.adapter_dim, s.adapter_dim),
    OURS_PROJECTOR + "projection/kernel": (s.adapter_dim, s.text_dim),
  }


def llama4_vision_to_hf(params: Mapping[str, np.ndarray], spec: Llama4VisionSpec) -> dict[str, np.ndarray]:
  """The Transformer's flat vision parameters -> tensors named as transformers 5's save_pretrained writes them."""
  tower, out = SAVED_TOWER_PREFIX, {}
  for ours, (theirs, kind) in _TOWER.items():
    w = np.asarray(params[OURS_TOWER + ours])
    out[tower + theirs] = w.reshape(-1, w.shape[-1]).T if kind == "patch" else _to_hf(w, kind)
  for ours, (theirs, kind) in _BLOCK.items():
    stacked = np.asarray(params[OURS_TOWER + "blocks/" + ours])
    for i in range(spec.num_layers):
      out[f"{tower}model.layers.{i}.{theirs}"] = _to_hf(stacked[i], kind)
  out[SAVED_PROJECTOR_PREFIX + _PROJECTION] = np.asarray(params[OURS_PROJECTOR + "projection/kernel"]).T
  return out
