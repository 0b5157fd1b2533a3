"""The decoder's layers built as stacks: one DecoderLayer whose parameters carry a leading layer axis per stack (the
main stack split around a pipeline, a repeating block's positions each stacked over its groups)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from maxtext.models import layer_pattern, pipeline
from maxtext.models.decoder_layer import DecoderLayer, LayerSpec
from maxtext.platform import Policy

LAYERS_AXIS = pipeline.LAYERS_AXIS
OUTSIDE_AXIS = pipeline.OUTSIDE_AXIS
DENSE_LAYERS_AXIS = layer_pattern.PREFIX_STACK  # DeepSeek's leading dense layers: a stack of their own, outside any pipeline


def _prepend_axis(variable: nnx.Variable, name: str) -> nnx.Variable:
  axes = variable.get_metadata().get("logical_axes") or (None,) * (variable[...].ndim - 1)
  return variable.replace(logical_axes=(name,) + tuple(axes))


def stacked_layers(spec: LayerSpec, policy: Policy, keys: jax.Array, axis: str) -> DecoderLayer:
  """One DecoderLayer whose parameters have a leading axis named `axis`, one layer per random key in keys."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLayer(spec, policy=policy, rngs=nnx.Rngs(0))))
  state = jax.vmap(lambda k: nnx.state(DecoderLayer(spec, policy=policy, rngs=nnx.Rngs(k))))(keys)
  state = jax.tree.map(lambda v: _prepend_axis(v, axis), state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.merge(graphdef, state)


def main_stacks(plan: pipeline.Plan | None, spec: LayerSpec, policy: Policy, rngs: nnx.Rngs, num_layers: int) -> tuple[DecoderLayer, DecoderLayer | None]:
  """The main stack's num_layers layers (those after first_num_dense_layers), stacked: (axis 'layers', the layers
  after them on axis 'layers_outside_pipeline', or None).

  Without a pipeline 'layers' holds them all. With one it holds the first pipeline_parallel_layers, sharded over
  `stage`, in the pipeline's train-state order; the rest, if any, form the second stack, not split by stage. Each
  layer gets the random key of its plain index, so every layout starts with the same weights.
  """
  keys = jax.random.split(rngs.params(), num_layers)
  if plan is None:
    return stacked_layers(spec, policy, keys, LAYERS_AXIS), None
  pipelined = stacked_layers(spec, policy, keys[: plan.layers][plan.order()], LAYERS_AXIS)
  return pipelined, stacked_layers(spec, policy, keys[plan.layers :], OUTSIDE_AXIS) if plan.outside else None


def block_stacks(
  stack: layer_pattern.Stack, layer_specs: tuple[LayerSpec, ...], policy: Policy, rngs: nnx.Rngs, plan: pipeline.Plan | None = None
) -> tuple[nnx.List, nnx.List | None]:
  """A stack whose structures repeat with period p > 1, scanned: (p stacked layers on axis stack.name, position j
  holding layers j, j + p, ...; the remainder's layers one by one, or None). Layer i gets the i-th random key. With
  a pipeline (whose units are the whole groups) the groups stand in its train-state order (plan.order())."""
  p, g = stack.period, stack.num_groups
  keys = jax.random.split(rngs.params(), len(stack.kinds))
  groups = np.arange(g) if plan is None else plan.order()
  block = nnx.List([stacked_layers(layer_specs[j], policy, keys[groups * p + j], stack.name) for j in range(p)])
  rest = [DecoderLayer(layer_specs[i], policy=policy, rngs=nnx.Rngs(keys[i])) for i in range(g * p, len(stack.kinds))]
  return block, nnx.List(rest) if rest else None
