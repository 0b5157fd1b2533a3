"""Pipeline parallelism: a circular schedule around the decoder's scanned layer loop, over the `stage` mesh axis.

With p stages, v repeats, l layers per stage visit (L = p v l pipelined layers), m microbatches and a forwarding
delay d (2 with pipeline_delay_activation_forwarding, else 1):

- Placement. Block b of l consecutive layers runs on stage b mod p, at repeat r = b div p. The train state holds the
  stacked layers stage-major (index s v l + r l + i holds layer (r p + s) l + i), so the `layers` axis, sharded over
  `stage`, gives each stage exactly its blocks. Checkpoints keep the plain order (`to_storage` / `from_storage`;
  the identity when v = 1), so the stored layout does not depend on the pipeline.
- Layers outside. With pipeline_parallel_layers = L below the main stack's M layers, only its first L layers form
  the pipelined stack; the other M - L form a second stack (logical axis 'layers_outside_pipeline', not split over
  `stage`) that the decoder runs after the pipeline on every stage, as it runs the embedding and the logits.
  Checkpoints join the two stacks into one plain-order 'layers' stack of M layers, split over `stage` on another
  dimension (mesh.over_axis) so that no device holds more of it than of the two stacks.
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
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from maxtext import mesh as mesh_lib
from maxtext.layers.moe import load_balance_from_sums
from maxtext.layers.sharding import Rules, logical_to_spec
from maxtext.models import remat
from maxtext.platform import Policy

STAGE_AXIS = "stage"
LAYERS_AXIS = "layers"  # the logical axis of the pipelined layer stack (sharded over `stage`)
OUTSIDE_AXIS = "layers_outside_pipeline"  # MaxText's name: the main-stack layers after pipeline_parallel_layers (not stage-sharded)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The schedule of one pipelined layer stack."""

  stages: int
  repeats: int
  layers_per_stage: int
  microbatches: int
  delay: int  # iterations between a stage's output and the next stage's use of it (1, or 2 with delayed forwarding)
  fsdp_ag_once: bool
  outside: int = 0  # main-stack layers after the pipelined ones (pipeline_parallel_layers), run unpipelined
  period: int = 1  # decoder layers per pipelined unit: a hybrid stack's block of different layers (layer_pattern.Stack.period)
  remainder: int = 0  # a hybrid stack's layers after its last whole block, run after the pipeline on every stage

  @property
  def layers(self) -> int:
    """Pipelined units (layers, or blocks of `period` layers): the length of the stacked layer axis."""
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
    unit = f"{self.layers_per_stage} layers" if self.period == 1 else f"{self.layers_per_stage} blocks of {self.period} layers"
    kind = f"circular ({self.repeats} repeats of {unit} per stage)" if self.repeats > 1 else f"GPipe ({unit} per stage)"
    return kind + (", delayed forwarding" if self.delay == 2 else "")

  def order(self) -> np.ndarray:
    """order[index in the train state] = plain layer index."""
    s, r, i = np.meshgrid(np.arange(self.stages), np.arange(self.repeats), np.arange(self.layers_per_stage), indexing="ij")
    return ((r * self.stages + s) * self.layers_per_stage + i).reshape(-1)


def banner(plan: Plan | None) -> str | None:
  """One line naming the schedule, stages, microbatches and bubble fraction (None without a pipeline)."""
  if plan is None:
    return None
  after = plan.outside + plan.remainder
  outside = f" ({after} after them run on every stage)" if after else ""
  piped = plan.layers * plan.period
  return (
    f"pipeline: {piped} of {piped + after} layers pipelined{outside}, {plan.schedule}, {plan.stages} stages, {plan.microbatches} microbatches, "
    f"{plan.iterations} iterations, "
    f"bubble {plan.bubble:.1%} = {plan.delay}x({plan.stages}-1)/({plan.microbatches}x{plan.repeats}+{plan.delay}x({plan.stages}-1))"
  )


# ------------------------------------------------------------------------------------- train state <-> checkpoints


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _stacked(v: Any) -> bool:
  """A Variable of the pipelined stack holding an array (optax's MaskedNode placeholders hold none)."""
  return _is_var(v) and hasattr(v.get_value(), "shape") and (v.get_metadata().get("logical_axes") or (None,))[0] == LAYERS_AXIS


def _spec_of(value: Any, first: str | None, axes: tuple, rules: Any, shape: tuple[int, ...] | None = None) -> Any:
  """value's NamedSharding (in its memory) with the leading axis's logical name `first` (None where value has no
  mesh); given the shape of a joined stack (first None), also split over `stage` where a dimension allows."""
  sharding = getattr(value, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  named = jax.sharding.NamedSharding(sharding.mesh, logical_to_spec((first, *axes[1:]), rules, sharding.mesh), memory_kind=sharding.memory_kind)
  return named if shape is None else mesh_lib.over_axis(named, shape, STAGE_AXIS)


def _apply(fn: Callable, values: list, shardings: list, donate: bool) -> list:
  """fn(list of arrays) -> list of arrays: jitted for device arrays (out_shardings given), numpy for host arrays,
  shapes only (jax.eval_shape) for abstract ones."""
  if all(isinstance(v, jax.ShapeDtypeStruct) for v in values):
    return [jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s) for o, s in zip(jax.eval_shape(fn, values), shardings, strict=True)]
  if all(isinstance(v, jax.Array) for v in values) and all(s is not None for s in shardings):
    return jax.jit(fn, out_shardings=shardings, donate_argnums=0 if donate else ())(values)
  return [np.asarray(o) for o in fn([np.asarray(v) for v in values])]


def _stacks(m: Any) -> tuple[dict, list, Any]:
  """(m as a plain dict, the Variables of its pipelined stack, that stack's treedef)."""
  raw = dict(m.raw_mapping) if isinstance(m, nnx.State) else dict(m)
  leaves, treedef = jax.tree.flatten(raw[LAYERS_AXIS], is_leaf=_is_var)
  return raw, leaves, treedef


def _rebuilt(m: Any, raw: dict) -> Any:
  return nnx.State(raw) if isinstance(m, nnx.State) else type(m)(raw)


def _join(m: Any, plan: Plan, rules: Any) -> Any:
  """A mapping holding the pipelined stack (train-state order) and the layers outside the pipeline -> one 'layers'
  stack of all main-stack layers in plain order."""
  raw, leaves, treedef = _stacks(m)
  outside = treedef.flatten_up_to(raw.pop(OUTSIDE_AXIS)) if plan.outside else [None] * len(leaves)
  chosen = [i for i, v in enumerate(leaves) if _stacked(v)]
  if not chosen:
    return _rebuilt(m, raw)
  plain = np.argsort(plan.order())

  def fn(xs: list) -> list:
    n = len(chosen)
    lib = jnp if not isinstance(xs[0], np.ndarray) else np
    joined = [lib.take(x, plain, axis=0) for x in xs[:n]]
    return [lib.concatenate([j, o], axis=0) for j, o in zip(joined, xs[n:], strict=True)] if plan.outside else joined

  values = [leaves[i].get_value() for i in chosen] + ([outside[i].get_value() for i in chosen] if plan.outside else [])
  axes = [tuple(leaves[i].get_metadata()["logical_axes"]) for i in chosen]
  joined = [(plan.layers + plan.outside, *leaves[i].get_value().shape[1:]) if plan.outside else None for i in chosen]
  shardings = [
    _spec_of(leaves[i].get_value(), None if plan.outside else LAYERS_AXIS, a, rules, shape) for i, a, shape in zip(chosen, axes, joined, strict=True)
  ]
  for i, value in zip(chosen, _apply(fn, values, shardings, donate=False), strict=True):
    leaves[i] = leaves[i].replace(value=value)
  raw[LAYERS_AXIS] = jax.tree.unflatten(treedef, leaves)
  return _rebuilt(m, raw)


def _split(m: Any, plan: Plan, rules: Any) -> Any:
  """The inverse of _join: plain-order 'layers' of all main-stack layers -> the pipelined stack in train-state order
  and, when some layers stay outside the pipeline, the stack of those ('layers_outside_pipeline')."""
  raw, leaves, treedef = _stacks(m)
  chosen = [i for i, v in enumerate(leaves) if _stacked(v)]
  outside = list(leaves)
  if chosen:
    order, n = plan.order(), plan.layers

    def fn(xs: list) -> list:
      lib = jnp if not isinstance(xs[0], np.ndarray) else np
      return [lib.take(x[:n], order, axis=0) for x in xs] + ([x[n:] for x in xs] if plan.outside else [])

    axes = [tuple(leaves[i].get_metadata()["logical_axes"]) for i in chosen]
    values = [leaves[i].get_value() for i in chosen]
    shardings = [_spec_of(v, LAYERS_AXIS, a, rules) for v, a in zip(values, axes, strict=True)]
    shardings += [_spec_of(v, OUTSIDE_AXIS, a, rules) for v, a in zip(values, axes, strict=True)] if plan.outside else []
    results = _apply(fn, values, shardings, donate=not plan.outside)  # split arrays cannot reuse the joined buffers
    for k, (i, a) in enumerate(zip(chosen, axes, strict=True)):
      leaves[i] = leaves[i].replace(value=results[k])
      if plan.outside:
        outside[i] = leaves[i].replace(value=results[len(chosen) + k], logical_axes=(OUTSIDE_AXIS, *a[1:]))
  raw[LAYERS_AXIS] = jax.tree.unflatten(treedef, leaves)
  if plan.outside:
    raw[OUTSIDE_AXIS] = jax.tree.unflatten(treedef, outside)
  return _rebuilt(m, raw)


def _convert(tree: Any, schedule: Schedule | None, to_plain: bool) -> Any:
  plan = schedule and schedule.plan
  if plan is None or (plan.repeats == 1 and not plan.outside):
    return tree
  convert = _join if to_plain else _split
  holds_stack = lambda x: isinstance(x, Mapping) and LAYERS_AXIS in x  # noqa: E731 - the model's, the optimizer's moments', ...
  return jax.tree.map(lambda m: convert(m, plan, schedule.rules) if holds_stack(m) else m, tree, is_leaf=lambda x: holds_stack(x) or _is_var(x))


def to_storage(tree: Any, schedule: Schedule | None) -> Any:
  """A train state (or any tree of its Variables, abstract ones included) as checkpoints hold it: one 'layers' stack
  of all main-stack layers in plain order, whatever the pipeline. A new array per stacked leaf while saving (its
  layer axis unsharded when layers stay outside the pipeline); the identity without a circular schedule or
  pipeline_parallel_layers."""
  return _convert(tree, schedule, to_plain=True)


def from_storage(tree: Any, schedule: Schedule | None) -> Any:
  """The inverse of to_storage: a restored tree in the layout the schedule (maxtext.models.pipeline_specs.pipeline) keeps in the train state (its
  arrays are donated)."""
  return _convert(tree, schedule, to_plain=False)


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
  win = jnp.asarray(np.asarray(windows, np.int32).reshape(p, v * lps, *np.shape(windows)[1:]))
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


# ------------------------------------------------------------------------------------- the wrapper around a stack


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The pipeline wrapped around the decoder's main layer stack (maxtext.models.pipeline_specs.pipeline builds it once).

  schedule(layers, x, positions, segment_ids, adapter_ids, windows, policy) runs the stacked layers under the plan's
  schedule, each stage's block with the per-layer scan and remat of the unpipelined decoder inside.
  """

  plan: Plan
  rules: Rules  # logical_axis_rules
  fsdp_axes: frozenset[str]  # the mesh axes of the 'embed' rule: gathered once per step with pipeline_fsdp_ag_once
  remat_policy: str
  experts_per_token: int  # num_experts_per_tok: the load-balance loss from statistics summed over microbatches

  def __call__(
    self,
    layers: nnx.Module,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    adapter_ids: jax.Array | None,
    windows: list[int],
    policy: Policy,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The stacked layers (train-state order) over x [B, ...] -> (y, per-layer MoE statistics in train-state order,
    lb_loss the full batch's). layers: one stacked layer, or (a hybrid stack, plan.period > 1) a list of one stacked
    layer per block position, each unit of the pipeline then a block of `period` layers run in order as the
    unpipelined decoder's maxtext.models.block_scan.run_block does. windows: each pipelined layer's attention window in plain order."""
    plan = self.plan
    hybrid = isinstance(layers, nnx.List)  # a block of different layers per unit; an ordinary stack runs as before
    blocks = list(layers) if hybrid else [layers]
    graphdefs, states = zip(*(nnx.split(m) for m in blocks))
    q = len(blocks)
    win = np.asarray(windows, np.int32).reshape(-1, q)  # [units, block position]
    static = [int(win[0, j]) if len(set(win[:, j].tolist())) == 1 else None for j in range(q)]
    lps = plan.layers_per_stage

    def stage_fn(w_s: Any, r: jax.Array, h: jax.Array, win_s: jax.Array, rows: tuple):
      positions_k, segments_k, adapters_k = rows

      def position(j: int):
        def body(h, i):
          h = checkpoint_name(h, remat.LAYER_INPUT)
          w = jax.tree.map(lambda a: checkpoint_name(a[r * lps + i], remat.SLICED_WEIGHTS), w_s[j] if hybrid else w_s)  # sliced inside the remat region
          layer = nnx.merge(graphdefs[j], remat.tied_to_carry(w, h, policy.dtypes.compute))
          window = static[j] if static[j] is not None else (win_s[r * lps + i, j] if hybrid else win_s[r * lps + i])
          return layer(h, positions_k, segments_k, window, adapter_ids=adapters_k)

        return remat.wrap(body, self.remat_policy, prevent_cse=False, offload_input=policy.offload_layer_inputs, sliced_weights=True)

      if not hybrid:
        return jax.lax.scan(position(0), h, jnp.arange(lps))
      steps = [position(j) for j in range(q)]

      def block(h, i):
        out = []
        for step in steps:
          h, stats = step(h, i)
          out.append(stats)
        return h, jax.tree.map(lambda *a: jnp.stack(a), *out)

      return jax.lax.scan(block, h, jnp.arange(lps))

    rows = (positions, segment_ids, adapter_ids)
    weights, unit_windows = (tuple(states), win) if hybrid else (states[0], np.asarray(windows))
    y, stats = run(plan, stage_fn, weights, x, rows, unit_windows[plan.order()], self.rules, set(self.fsdp_axes))
    if hybrid:
      stats = jax.tree.map(lambda a: a.reshape(a.shape[0] * q, *a.shape[2:]), stats)  # [units, q, ...] -> per layer
    # Loads, router probabilities and token counts were summed over microbatches: the full batch's load-balance loss.
    stats["lb_loss"] = load_balance_from_sums(stats["load"], stats["router_probs"], stats["tokens"], self.experts_per_token)
    return y, stats
