"""Split a scanned model's stacked layer parameters into one module per layer, once, for decoding on hosts where a
scan's per-layer weight slices are copies (XLA:CPU copies each slice before its matmul; TPU and GPU fuse it)."""

from __future__ import annotations

import dataclasses

from flax import nnx

from maxtext.models import layer_pattern
from maxtext.models.decoder import Transformer


def unstack_layers(model: Transformer) -> Transformer:
  """The same model with scan_layers=false: layer i's parameters are the stacked arrays' i-th slices (a one-time copy)."""
  if not model.spec.scan_layers:
    return model
  spec = dataclasses.replace(model.spec, scan_layers=False)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(spec, policy=model.policy, rngs=nnx.Rngs(0))))
  stacked = dict(nnx.to_flat_state(nnx.state(model)))
  stacks = {stack.name: stack for stack in model.stacks}
  leaves = {}
  for path, var in nnx.to_flat_state(abstract):
    stack = stacks.get(path[0])
    if stack is not None and stack.period > 1:  # a block of stacked layers, one per block position, and the remainder's
      j, index = stack.locate(int(path[1]))
      value = stacked[(path[0], j, *path[2:])][...][index] if j is not None else stacked[(layer_pattern.REMAINDER, index, *path[2:])][...]
    elif stack is not None:
      value = stacked[(path[0], *path[2:])][...][int(path[1])]
    else:
      value = stacked[path][...]
    leaves[path] = var.replace(value)
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def for_decoding(model: Transformer) -> Transformer:
  """The layer arrangement decoding runs fastest with on the model's platform (`Policy.unstacked_decode`): per-layer
  arrays on CPU, where a scan's slices of stacked weights and caches are copies that keep a batch-1 step several
  times above the weight-streaming bound (figure: benchmarks/README.md, figures behind code comments); as trained
  elsewhere."""
  return unstack_layers(model) if model.policy.unstacked_decode else model
