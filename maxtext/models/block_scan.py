"""A repeating block of layers of different structures (qwen3_next's Gated DeltaNet layers and an attention layer),
scanned group by group over its stacked positions (maxtext.models.layer_stacks.block_stacks builds them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.models import layer_pattern, remat
from maxtext.models.remat import tied_to_carry
from maxtext.platform import Policy


def run_block(
  stack: layer_pattern.Stack,
  block: nnx.List,
  x: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array | None,
  adapter_ids: jax.Array | None,
  *,
  remat_policy: str,
  policy: Policy,
  image_ids: jax.Array | None = None,
  per_layer: jax.Array | None = None,
  token_ids: jax.Array | None = None,
):
  """A repeating block of p layers of different structures (p stacks of num_groups layers each), scanned group by
  group -> (x, per-layer statistics of the whole groups, in layer order). A block position whose window is the same
  in every group gets it as a constant, otherwise as a scan input."""
  p, g = stack.period, stack.num_groups
  offload, compute = policy.offload_layer_inputs, policy.dtypes.compute
  graphdefs, states = zip(*(nnx.split(m) for m in block))
  windows = np.asarray(stack.windows[: g * p], np.int32).reshape(g, p)
  static = [int(windows[0, j]) if len(set(windows[:, j].tolist())) == 1 else None for j in range(p)]
  images = {} if image_ids is None else {"image_ids": image_ids}
  if token_ids is not None:
    images["token_ids"] = token_ids

  # KV sharing: a stack with KV-shared layers never repeats (p = all its layers, one group), so each shared layer
  # finds its source's keys and values within the group.
  sharing = any(k.kv_shared for k in stack.kinds)

  def position(j: int, static_window: int | None, return_kv: bool):
    # Every array the layer reads is an argument (none closed over): sequential_backward's custom VJP differentiates
    # a function of its arguments only.
    def step(h, layer_state, extra, inputs):
      h = checkpoint_name(h, remat.LAYER_INPUT)
      layer = nnx.merge(graphdefs[j], tied_to_carry(layer_state, h, compute))
      inputs = dict(inputs)
      window = static_window if static_window is not None else inputs.pop("window")
      return layer(h, inputs.pop("positions"), inputs.pop("segment_ids"), window, return_kv=return_kv, **inputs, **extra)

    rematted = remat.wrap(step, remat_policy, prevent_cse=False, offload_input=offload)
    # The group's layers run their backward passes in turn (one layer's recomputed activations live at a time);
    # not with nothing to recompute, nor with the inputs offloaded to host memory (barriers on them not tried).
    return rematted if remat_policy == "none" or offload else remat.sequential_backward(rematted)

  def body(h, xs):
    group_states, group_windows, group_inputs = xs
    out, shared = [], {}
    for j in range(p):
      kind = stack.kinds[j]
      extra = {} if group_inputs is None else {"per_layer_input": group_inputs[j]}
      if kind.kv_shared:
        extra["shared_kv"] = shared[static[j]]
      emit = sharing and not kind.kv_shared
      inputs = dict(positions=positions, segment_ids=segment_ids, adapter_ids=adapter_ids, **images)
      if static[j] is None:
        inputs["window"] = group_windows[j]
      res = position(j, static[j], emit)(h, group_states[j], extra, inputs)
      h, aux = res[0], res[1]
      if emit:
        shared[static[j]] = res[2]
      out.append(aux)
    return h, jax.tree.map(lambda *a: jnp.stack(a), *out)

  grouped_inputs = None if per_layer is None else per_layer.reshape(g, p, *per_layer.shape[1:])
  x, stats = jax.lax.scan(body, x, (tuple(states), jnp.asarray(windows), grouped_inputs))
  return x, jax.tree.map(lambda a: a.reshape(g * p, *a.shape[2:]), stats)
