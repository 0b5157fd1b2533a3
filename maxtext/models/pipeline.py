"""Pipeline parallelism: a circular schedule around the decoder's scanned layer loop, over the `stage` mesh axis.

With p stages, v repeats, l layers per stage visit (L = p v l pipelined layers), m microbatches and a forwarding
delay d (2 with pipeline_delay_activation_forwarding, else 1):

- Placement. Block b of l consecutive layers runs on stage b mod p, at repeat r = b div p. The train state holds the
  stacked layers stage-major (index s v l + r l + i holds layer (r p + s) l + i), so the `layers` axis, sharded over
  `stage`, gives each stage exactly its blocks. Checkpoints keep the plain order (`to_storage` / `from_storage`;
  the identity when v = 1), so the stored layout does not depend on the pipeline.
- Schedule. Work item j = r m + k is microbatch k at repeat r. In iteration t stage s runs item j = t - d s when
  0 <= j < m v, on its block r = j div m, with the per-layer scan and remat of the unpipelined decoder inside.
  T = m v + d (p - 1) iterations; the bubble (work discarded) is d (p - 1) / (m v + d (p - 1)).
- Transfer. After each iteration every stage's output moves one stage up (a collective permute over `stage`); with
  d = 2 an output waits one iteration first, so the transfer overlaps the next iteration's compute. The last stage's
  output wraps to stage 0, which keeps it in its feed slot k until item j + m starts there (m >= d p when v > 1).
  The feed starts as the embedded microbatches and ends holding the final outputs.
- All stages run every iteration as one vmapped program (`spmd_axis_name='stage'`): stage-sharded buffers make every
  step local except the permute; bubble iterations compute on zeros and their results and statistics are masked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from maxtext.config import MaxTextConfig
from maxtext.config.derived import axis_size
from maxtext.mesh import logical_to_spec

STAGE_AXIS = "stage"
LAYERS_AXIS = "layers"  # the logical axis of the pipelined layer stack (sharded over `stage`)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The schedule of one pipelined layer stack."""

  stages: int
  repeats: int
  layers_per_stage: int
  microbatches: int
  delay: int  # iterations between a stage's output and the next stage's use of it (1, or 2 with delayed forwarding)
  fsdp_ag_once: bool

  @classmethod
  def of(cls, config: MaxTextConfig) -> Plan | None:
    """The config's pipeline, or None without pipeline parallelism."""
    stages = axis_size(config.ici_parallelism, config.dcn_parallelism, config.mesh_axes, STAGE_AXIS)
    if stages == 1:
      return None
    return cls(
      stages,
      config.num_pipeline_repeats,
      config.num_layers_per_pipeline_stage,
      config.num_pipeline_microbatches,
      2 if config.pipeline_delay_activation_forwarding else 1,
      config.pipeline_fsdp_ag_once,
    )

  @property
  def layers(self) -> int:
    return self.stages * self.repeats * self.layers_per_stage

  @property
  def iterations(self) -> int:
    return self.microbatches * self.repeats + self.delay * (self.stages - 1)

  @property
  def bubble(self) -> float:
    """Fraction of stage iterations whose work is discarded."""
    return self.delay * (self.stages - 1) / self.iterations

  @property
  def schedule(self) -> str:
    kind = (
      f"circular ({self.repeats} repeats of {self.layers_per_stage} layers per stage)"
      if self.repeats > 1
      else f"GPipe ({self.layers_per_stage} layers per stage)"
    )
    return kind + (", delayed forwarding" if self.delay == 2 else "")

  def order(self) -> np.ndarray:
    """order[index in the train state] = plain layer index."""
    s, r, i = np.meshgrid(np.arange(self.stages), np.arange(self.repeats), np.arange(self.layers_per_stage), indexing="ij")
    return ((r * self.stages + s) * self.layers_per_stage + i).reshape(-1)


def banner(config: MaxTextConfig) -> str | None:
  """One line naming the schedule, stages, microbatches and bubble fraction (None without a pipeline)."""
  plan = Plan.of(config)
  if plan is None:
    return None
  return (
    f"pipeline: {plan.schedule}, {plan.stages} stages, {plan.microbatches} microbatches, {plan.iterations} iterations, "
    f"bubble {plan.bubble:.1%} = {plan.delay}x({plan.stages}-1)/({plan.microbatches}x{plan.repeats}+{plan.delay}x({plan.stages}-1))"
  )


# ------------------------------------------------------------------------------------- train state <-> checkpoints


def _permute_layers(tree: Any, config: MaxTextConfig, to_plain: bool) -> Any:
  """Permute the leading axis of every array Variable whose first logical axis is 'layers', in one compiled program
  (a restored tree's arrays are donated to it)."""
  plan = Plan.of(config)
  if plan is None or plan.repeats == 1:
    return tree
  index = np.argsort(plan.order()) if to_plain else plan.order()
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_var)
  chosen = [
    i
    for i, v in enumerate(leaves)
    if is_var(v) and isinstance(v.get_value(), jax.Array) and (v.get_metadata().get("logical_axes") or (None,))[0] == LAYERS_AXIS
  ]
  if not chosen:
    return tree
  arrays = [leaves[i].get_value() for i in chosen]
  permute = jax.jit(lambda xs: [jnp.take(x, index, axis=0) for x in xs], out_shardings=[a.sharding for a in arrays], donate_argnums=() if to_plain else 0)
  for i, value in zip(chosen, permute(arrays), strict=True):
    leaves[i] = leaves[i].replace(value=value)
  return jax.tree.unflatten(treedef, leaves)


def to_storage(tree: Any, config: MaxTextConfig) -> Any:
  """A train state (or any tree of its Variables) with the pipelined layer stack in plain layer order, as checkpoints
  hold it. A new array per permuted leaf while saving; the identity without a circular pipeline."""
  return _permute_layers(tree, config, to_plain=True)


def from_storage(tree: Any, config: MaxTextConfig) -> Any:
  """The inverse of to_storage: a restored tree in the order this config's pipeline keeps in the train state."""
  return _permute_layers(tree, config, to_plain=False)


# ----------------------------------------------------------------------------------------------------- the schedule


def _spec(mesh: Any, rules: Any, logical: tuple, lead: tuple = ()) -> PartitionSpec:
  return PartitionSpec(*lead, *logical_to_spec(logical, rules, mesh))


def _constrain(x: jax.Array, spec: PartitionSpec | None) -> jax.Array:
  return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


def _gathered(spec: PartitionSpec, logical: tuple, fsdp_axes: set[str]) -> PartitionSpec:
  """spec without the FSDP mesh axes (kept on expert dimensions: those are expert parallelism)."""
  parts = []
  for part, name in zip(spec, logical, strict=False):
    names = (part,) if isinstance(part, str) else tuple(part or ())
    kept = names if name == "exp" else tuple(a for a in names if a not in fsdp_axes)
    parts.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return PartitionSpec(*parts, *spec[len(parts) :])


def stage_weights(plan: Plan, weights: nnx.State, rules: Any, fsdp_axes: set[str]) -> nnx.State:
  """The stacked layer weights [L, ...] viewed as [stages, repeats * layers_per_stage, ...], stage-sharded; with
  pipeline_fsdp_ag_once, gathered over the FSDP axes here, once, instead of per layer visit inside the loop."""
  mesh = jax.sharding.get_abstract_mesh()

  def one(v: nnx.Variable) -> nnx.Variable:
    value = v.get_value()
    shaped = value.reshape(plan.stages, -1, *value.shape[1:])
    if mesh.empty:
      return v.replace(value=shaped)
    logical = tuple(v.get_metadata().get("logical_axes") or (None,) * value.ndim)[1:]
    spec = _spec(mesh, rules, logical, (STAGE_AXIS, None))
    if plan.fsdp_ag_once:
      spec = PartitionSpec(STAGE_AXIS, None, *_gathered(PartitionSpec(*spec[2:]), logical, fsdp_axes))
    return v.replace(value=_constrain(shaped, spec))

  return jax.tree.map(one, weights, is_leaf=lambda x: isinstance(x, nnx.Variable))


StageFn = Callable[[nnx.State, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def run(
  plan: Plan,
  stage_fn: StageFn,
  weights: nnx.State,
  x: jax.Array,
  rows: Any,
  windows: np.ndarray,
  rules: Any,
  fsdp_axes: set[str],
) -> tuple[jax.Array, Any]:
  """Run the pipelined layer stack over x [B, ...] -> (y [B, ...], per-layer statistics [L, ...] summed over microbatches).

  stage_fn(weights_s, r, h, windows_s, rows_k) -> (h, statistics [layers_per_stage, ...]) runs one stage's block r
  (weights_s and windows_s hold the stage's repeats x layers_per_stage layers, block r at r x layers_per_stage on)
  on one microbatch h, whose per-row
  inputs (positions, segment ids, adapter ids: the pytree `rows` of [B, ...] arrays) are rows_k.
  weights: the stacked layers [L, ...] in train-state order; windows [L] int in the same order. Statistics come back
  in train-state order too.
  """
  p, v, lps, m, d = plan.stages, plan.repeats, plan.layers_per_stage, plan.microbatches, plan.delay
  items = m * v
  batch = x.shape[0]
  mesh = jax.sharding.get_abstract_mesh()
  staged = not mesh.empty and mesh.shape.get(STAGE_AXIS, 1) > 1

  def micro(a: jax.Array) -> jax.Array:  # [B, ...] -> [m, B/m, ...]; microbatch k holds rows i m + k (each device keeps its rows)
    return jnp.swapaxes(a.reshape(batch // m, m, *a.shape[1:]), 0, 1)

  act_logical = ("activation_batch", "activation_length") + (None,) * (x.ndim - 3) + ("activation_embed",)
  state_spec = _spec(mesh, rules, act_logical, (STAGE_AXIS,)) if staged else None
  feed_spec = _spec(mesh, rules, act_logical, (STAGE_AXIS, None)) if staged else None

  rows_mb = jax.tree.map(micro, rows)
  feed = _constrain(jnp.broadcast_to(micro(x)[None], (p, m, batch // m, *x.shape[1:])), feed_spec)
  state = _constrain(jnp.zeros((p, batch // m, *x.shape[1:]), x.dtype), state_spec)
  w = stage_weights(plan, weights, rules, fsdp_axes)
  win = jnp.asarray(np.asarray(windows, np.int32).reshape(p, v * lps))
  stage_ids = jnp.arange(p)
  vmap = jax.vmap if not staged else lambda f: jax.vmap(f, spmd_axis_name=STAGE_AXIS)

  def visit(s, state_s, feed_s, w_s, win_s, t):
    j = t - d * s
    valid = (j >= 0) & (j < items)
    j = jnp.clip(j, 0, items - 1)
    r, k = j // m, j % m
    h = jnp.where(s == 0, feed_s[k], state_s)
    out, stats = stage_fn(w_s, r, h, win_s, jax.tree.map(lambda a: a[k], rows_mb))
    return out, jax.tree.map(lambda a: jnp.where(valid, a, jnp.zeros_like(a)), stats), r

  def deliver(s, feed_s, arriving_s, item):
    """Stage 0 keeps what wraps around from the last stage (item `item`) in its feed slot."""
    keep = (s == 0) & (item >= 0) & (item < items)
    slot = jnp.clip(item, 0, items - 1) % m
    return feed_s.at[slot].set(jnp.where(keep, arriving_s, feed_s[slot]))

  def add_stats(acc_s, stats_s, r):
    return jax.tree.map(lambda a, x: a.at[r].add(x), acc_s, stats_s)

  def iteration(carry, t):
    state, inflight, feed, acc = carry
    out, stats, r = vmap(lambda *a: visit(*a, t))(stage_ids, state, feed, w, win)
    acc = vmap(add_stats)(acc, stats, r)
    if d == 1:
      arriving, item = jnp.roll(out, 1, axis=0), t - (p - 1)
    else:
      arriving, item, inflight = jnp.roll(inflight, 1, axis=0), t - 1 - d * (p - 1), out
    arriving = _constrain(arriving, state_spec)
    feed = _constrain(vmap(lambda *a: deliver(*a, item))(stage_ids, feed, arriving), feed_spec)
    return (arriving, inflight, feed, acc), None

  stats_shape = jax.eval_shape(lambda: visit(jnp.int32(0), state[0], feed[0], jax.tree.map(lambda a: a[0], w), win[0], jnp.int32(0))[1])
  acc = jax.tree.map(lambda a: jnp.zeros((p, v, *a.shape), a.dtype), stats_shape)
  inflight = state if d == 2 else None
  (_, inflight, feed, acc), _ = jax.lax.scan(iteration, (state, inflight, feed, acc), jnp.arange(plan.iterations))
  if d == 2:  # the last item is still in flight
    arriving = _constrain(jnp.roll(inflight, 1, axis=0), state_spec)
    feed = vmap(lambda *a: deliver(*a, items - 1))(stage_ids, feed, arriving)
  y = jnp.swapaxes(feed[0], 0, 1).reshape(x.shape)
  stats = jax.tree.map(lambda a: a.reshape(p * v * lps, *a.shape[3:]), acc)
  return y, stats
