"""Optimizers (optax) without the learning rate: the step scales updates by the schedule's rate.

Keeping the rate out of optax makes the train state's `step` the single source of the
schedule position (a skipped step does not desynchronise it).

With several LoRA adapters (lora.max_lora_adapters > 1) the optimizer leaves an adapter slot that got no
gradient this step exactly as it was, parameters and moments (`keep_unused_adapter_slots`): weight decay
and momentum do not move an adapter that no document in the batch trains.

vision_learning_rate_scale multiplies the vision tower's updates (weight decay included) after the optimizer.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from maxtext.config import MaxTextConfig
from maxtext.config.adapters import is_adapter_path
from maxtext.config.adapters import slot_axis as lora_slot_axis
from maxtext.train.trainable import VISION_TOWER

NO_DECAY_NAMES = ("scale", "bias", "sinks")  # norm scales, biases (also per-head ones), attention sink logits
LORA_SLOT_AXIS = "lora_slot"  # the adapter-slot axis of a multi-adapter model, named here for Muon (it has no logical name)
MUON_BATCH_AXES = ("layers", "layers_outside_pipeline", "dense_layers", "exp", LORA_SLOT_AXIS)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _path_names(path: tuple) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def decay_mask(params: Any, excluded: tuple[str, ...] = ()) -> Any:
  """True for parameters that get weight decay: everything except norm scales, biases and sinks, and parameters
  whose path ('layers/mlp/wi_0/kernel') one of the regular expressions `excluded` finds (adamw_mask)."""
  patterns = [re.compile(p) for p in excluded]

  def decays(path: tuple) -> bool:
    names = _path_names(path)
    return not _is_vector_path(names) and not any(p.search(_joined(names)) for p in patterns)

  return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def parameter_paths(params: Any) -> list[str]:
  """Every parameter's path as adamw_mask's patterns see it ('layers/mlp/wi_0/kernel')."""
  return [_joined(_path_names(path)) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _is_vector_path(names: list[str]) -> bool:
  """A norm scale, bias or sink: no weight decay, and AdamW rather than Muon even when it has two axes (a [heads, head_dim] bias)."""
  return any(n in name for name in names for n in NO_DECAY_NAMES)


def _joined(names: list[str]) -> str:
  """A parameter's path as 'layers/mlp/wi_0/kernel' (nnx states add a trailing 'value'; optimizer moments lead with their own keys)."""
  return "/".join(names[:-1] if names and names[-1] == "value" else names)


def _is_adapter_path(names: list[str]) -> bool:
  """An adapter matrix, by lora's rule."""
  return is_adapter_path(_joined(names))


def adapter_slot_axes(params: Any, slot_axis: int) -> Any:
  """slot_axis for the adapter matrices (paths ending lora/lora_a or lora/lora_b) of a multi-adapter model, -1 elsewhere."""
  return jax.tree_util.tree_map_with_path(lambda path, _: slot_axis if _is_adapter_path(_path_names(path)) else -1, params)


def _slot_mask(used: jax.Array, axis: int, ndim: int) -> jax.Array:
  """used [slots] broadcast against an array whose slot axis is `axis`."""
  return used.reshape((1,) * axis + used.shape + (1,) * (ndim - axis - 1))


def keep_unused_adapter_slots(inner: optax.GradientTransformation, slot_axis: int) -> optax.GradientTransformation:
  """inner, except that an adapter slot none of whose gradients is nonzero this step is not changed at all.

  A slot counts as trained when any entry of its A or B gradient, in any layer, is nonzero. For the other
  slots the update is zero and every optimizer-state entry shaped like the parameters (Adam's moments,
  SGD's trace) keeps its old value, so neither weight decay nor momentum moves an adapter that no row of the
  batch uses, and its moments are where its last training step left them. Scalars such as Adam's step
  count are shared by all slots and advance as usual.
  """

  def update(grads, state, params=None):
    updates, new_state = inner.update(grads, state, params)
    axes = adapter_slot_axes(grads, slot_axis)
    per_leaf = [
      jnp.any(g != 0, axis=tuple(i for i in range(g.ndim) if i != a)) for g, a in zip(jax.tree.leaves(grads), jax.tree.leaves(axes), strict=True) if a >= 0
    ]
    if not per_leaf:
      return updates, new_state
    used = functools.reduce(jnp.logical_or, per_leaf)

    def keep(path, new, old):
      """old where the slot is unused, for adapter arrays (parameters' updates, and the moments, which optax keeps at
      the parameters' paths and shapes); anything else (counts, optax's MaskedNode) passes through."""
      adapter = hasattr(new, "ndim") and new.ndim > slot_axis and new.shape[slot_axis] == used.shape[0] and _is_adapter_path(_path_names(path))
      return jnp.where(_slot_mask(used, slot_axis, new.ndim), new, old) if adapter else new

    updates = jax.tree_util.tree_map_with_path(lambda path, u: keep(path, u, jnp.zeros_like(u)), updates)
    new_state = jax.tree_util.tree_map_with_path(keep, new_state, state, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    return updates, new_state

  return optax.GradientTransformation(inner.init, update)


def muon_dimension_numbers(logical_axes: tuple[str | None, ...] | None) -> MuonDimensionNumbers | None:
  """Which axes of a kernel Muon orthogonalises; None -> the parameter uses AdamW.

  Axes named 'layers' or 'exp' are batch axes. Embedding/output tables (a 'vocab' axis) and
  vectors use AdamW. A kernel whose first matrix axis is 'embed' maps embed -> the rest
  (q/k/v, mlp in); otherwise the last axis is the output (attention out, mlp out).
  """
  if not logical_axes or "vocab" in logical_axes:
    return None
  matrix = [i for i, name in enumerate(logical_axes) if name not in MUON_BATCH_AXES]
  if len(matrix) < 2:
    return None
  if logical_axes[matrix[0]] == "embed":
    return MuonDimensionNumbers(reduction_axis=(matrix[0],), output_axis=tuple(matrix[1:]))
  return MuonDimensionNumbers(reduction_axis=tuple(matrix[:-1]), output_axis=(matrix[-1],))


def _muon_dims_tree(params: Any, slot_axis: int | None = None) -> Any:
  """Muon's dimension numbers per parameter; with several adapters (slot_axis set), each slot's A and B are
  orthogonalised on their own (the slot axis is a batch axis), so no slot's update depends on another's gradient."""

  def one(path: tuple, v: Any) -> MuonDimensionNumbers | None:
    if _is_vector_path(_path_names(path)):
      return None
    axes = getattr(v, "logical_axes", None)
    if axes and slot_axis is not None and _is_adapter_path(_path_names(path)):
      axes = tuple(LORA_SLOT_AXIS if i == slot_axis else name for i, name in enumerate(axes))
    return muon_dimension_numbers(axes)

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_variable)


def scale_vision_tower(scale: float) -> optax.GradientTransformation:
  """Multiplies the vision tower's updates (paths under VISION_TOWER) by scale: its learning rate is scale x the schedule's."""

  def update(updates, state, params=None):
    del params
    scaled = jax.tree_util.tree_map_with_path(
      lambda path, u: u * jnp.asarray(scale, u.dtype) if tuple(_path_names(path)[: len(VISION_TOWER)]) == VISION_TOWER else u, updates
    )
    return scaled, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def mu_dtype(config: MaxTextConfig) -> jnp.dtype:
  """Storage dtype of the first moment (AdamW's and Muon's mu, SGD's momentum trace): mu_dtype, or weight_dtype when
  unset (MaxText's rule). optax computes each moment update in the gradients' dtype and stores it in this one."""
  return jnp.dtype(config.mu_dtype or config.weight_dtype)


def build(config: MaxTextConfig) -> optax.GradientTransformation:
  """Gradient clipping + the chosen optimizer at unit learning rate (updates are -direction)."""
  decays = functools.partial(decay_mask, excluded=tuple(config.adamw_mask))
  slot_axis = None
  if config.lora.enable_lora and config.lora.max_lora_adapters > 1:
    slot_axis = lora_slot_axis(config)
  if config.opt_type == "adamw":
    opt = optax.adamw(
      1.0,
      b1=config.adam_b1,
      b2=config.adam_b2,
      eps=config.adam_eps,
      eps_root=config.adam_eps_root,
      weight_decay=config.adam_weight_decay,
      mu_dtype=mu_dtype(config),
      mask=decays,
    )
  elif config.opt_type == "sgd":
    opt = optax.sgd(1.0, momentum=config.sgd_momentum or None, accumulator_dtype=mu_dtype(config))
  else:
    # Muon's inner AdamW has no decay mask, so decay is added once, masked, for all parameters.
    muon = optax.contrib.muon(
      1.0,
      beta=config.muon_beta,
      adam_b1=config.adam_b1,
      adam_b2=config.adam_b2,
      eps=config.adam_eps,
      adam_eps_root=config.adam_eps_root,
      mu_dtype=mu_dtype(config),
      muon_weight_dimension_numbers=functools.partial(_muon_dims_tree, slot_axis=slot_axis),
    )
    opt = optax.chain(muon, optax.add_decayed_weights(-config.adam_weight_decay, mask=decays))
  if config.gradient_clipping_threshold > 0:
    opt = optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), opt)
  if slot_axis is not None:
    opt = keep_unused_adapter_slots(opt, slot_axis)
  if config.vision_learning_rate_scale != 1.0:
    opt = optax.chain(opt, scale_vision_tower(config.vision_learning_rate_scale))
  return opt
