"""Optimizers (optax) without the learning rate: the step scales updates by the schedule's rate.

Keeping the rate out of optax makes the train state's `step` the single source of the
schedule position (a skipped step does not desynchronise it).
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from maxtext.config import MaxTextConfig

NO_DECAY_NAMES = ("scale", "bias")
MUON_BATCH_AXES = ("layers", "exp")


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _path_names(path: tuple) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def decay_mask(params: Any) -> Any:
  """True for parameters that get weight decay: everything except norm scales and biases."""
  return jax.tree_util.tree_map_with_path(lambda path, _: not any(n in name for name in _path_names(path) for n in NO_DECAY_NAMES), params)


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


def _muon_dims_tree(params: Any) -> Any:
  return jax.tree.map(lambda v: muon_dimension_numbers(getattr(v, "logical_axes", None)), params, is_leaf=_is_variable)


def build(config: MaxTextConfig) -> optax.GradientTransformation:
  """Gradient clipping + the chosen optimizer at unit learning rate (updates are -direction)."""
  if config.opt_type == "adamw":
    opt = optax.adamw(
      1.0,
      b1=config.adam_b1,
      b2=config.adam_b2,
      eps=config.adam_eps,
      eps_root=config.adam_eps_root,
      weight_decay=config.adam_weight_decay,
      mask=decay_mask,
    )
  elif config.opt_type == "sgd":
    opt = optax.sgd(1.0, momentum=config.sgd_momentum or None)
  else:
    # Muon's inner AdamW has no decay mask, so decay is added once, masked, for all parameters.
    muon = optax.contrib.muon(
      1.0,
      beta=config.muon_beta,
      adam_b1=config.adam_b1,
      adam_b2=config.adam_b2,
      eps=config.adam_eps,
      adam_eps_root=config.adam_eps_root,
      muon_weight_dimension_numbers=_muon_dims_tree,
    )
    opt = optax.chain(muon, optax.add_decayed_weights(-config.adam_weight_decay, mask=decay_mask))
  if config.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), opt)
  return opt
