"""DiLoCo (enable_diloco): data-parallel replica groups that train apart and synchronise every H steps.

The mesh's outermost axis 'diloco' splits the devices into G groups (ici_diloco_parallelism x dcn_diloco_parallelism).
The state keeps one copy of the model per group, stacked on a leading axis split over 'diloco', next to the global
parameters and the outer optimizer's state:

    {"step": int32[],                    inner steps taken (the run's step)
     "params": nnx.State,                the global parameters (what eval reads), replicated over 'diloco'
     "outer_opt_state": optax state,     the outer Nesterov SGD's momentum, over the global parameters
     "inner": {"params", "opt_state", "spike"?}   each group's train state, [G, ...] over 'diloco'}

An inner step is the plain train step mapped over the group axis (`jax.vmap(..., spmd_axis_name='diloco')`) on each
group's share of the batch: nothing reduces over 'diloco', so no inner step sends a byte between groups. After every
diloco_sync_period-th step the groups exchange their parameters once (the mean over 'diloco'), the outer optimizer
`optax.sgd(diloco_outer_lr, diloco_outer_momentum, nesterov=True)` applies the mean delta (global - mean of the
groups) to the global parameters, and every group restarts from them; each group keeps its own inner optimizer state
(DiLoCo, arXiv 2311.08105, section 6.1). The step's metrics stay per group ([G], split over 'diloco', averaged on the
host: counts summed), so they do not cross groups either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtext.config import MaxTextConfig
from maxtext.config.parallelism import DILOCO_AXIS, axis_size

INNER = "inner"
SHARED = ("step", "other")  # parts of the plain state every group shares (other: non-parameter model variables, which no step changes here)
OUTER_OPT = "outer_opt_state"


def groups(config: MaxTextConfig) -> int:
  """The number of DiLoCo replica groups (the size of the 'diloco' mesh axis)."""
  return axis_size(config.ici_parallelism, config.dcn_parallelism, config.mesh_axes, DILOCO_AXIS)


def outer_optimizer(config: MaxTextConfig) -> optax.GradientTransformation:
  return optax.sgd(config.diloco_outer_lr, momentum=config.diloco_outer_momentum, nesterov=True)


def _stacked(sharding: NamedSharding) -> NamedSharding:
  """sharding of one group's array -> that of the [G, ...] stack split over 'diloco'."""
  return NamedSharding(sharding.mesh, PartitionSpec(DILOCO_AXIS, *sharding.spec), memory_kind=sharding.memory_kind)


def _per_group(tree: Any, g: int) -> Any:
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (g, *x.shape)), tree)


def make_init_fn(config: MaxTextConfig, init_fn: Callable[[], dict], outer: optax.GradientTransformation) -> Callable[[], dict]:
  """The DiLoCo state's init from the plain train state's init: every group starts from the global parameters."""
  g = groups(config)

  def init() -> dict:
    state = init_fn()
    inner = {k: v for k, v in state.items() if k not in SHARED}
    shared = {k: state[k] for k in SHARED if k in state}
    return {**shared, "params": state["params"], OUTER_OPT: outer.init(state["params"]), INNER: _per_group(inner, g)}

  return init


def state_shardings(config: MaxTextConfig, mesh: Mesh, abstract: dict, plain: dict) -> dict:
  """The DiLoCo state's shardings, from `plain` (the plain train state's): the groups' states stacked over 'diloco',
  the global parameters and the outer momentum as the plain parameters are."""
  from maxtext.train import state as state_lib

  outer = state_lib.shardings({OUTER_OPT: abstract[OUTER_OPT]}, config, mesh)[OUTER_OPT]
  inner = {k: jax.tree.map(_stacked, v) for k, v in plain.items() if k not in SHARED}
  shared = {k: plain[k] for k in SHARED if k in plain}
  return {**shared, "params": plain["params"], OUTER_OPT: outer, INNER: inner}


def metrics_sharding(mesh: Mesh) -> NamedSharding:
  """The step's metrics: one value per group, each on its own group's devices."""
  return NamedSharding(mesh, PartitionSpec(DILOCO_AXIS))


def make_train_step(config: MaxTextConfig, train_step: Callable, outer: optax.GradientTransformation) -> Callable:
  """The DiLoCo step from the plain one: an inner step on every group, then the synchronisation when due."""
  g, period = groups(config), config.diloco_sync_period

  def sync(state: dict) -> dict:
    inner_params = state[INNER]["params"]
    mean = jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0), inner_params)  # the one exchange between groups
    delta = jax.tree.map(lambda p, m: p.astype(jnp.float32) - m, state["params"], mean)  # the outer gradient
    updates, outer_state = outer.update(delta, state[OUTER_OPT], state["params"])
    params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), state["params"], updates)
    restarted = jax.tree.map(lambda p, x: jnp.broadcast_to(p, x.shape), params, inner_params)
    return dict(state, params=params, **{OUTER_OPT: outer_state, INNER: dict(state[INNER], params=restarted)})

  def step(state: dict, batch: dict) -> tuple[dict, dict]:
    grouped = jax.tree.map(lambda x: x.reshape(g, x.shape[0] // g, *x.shape[1:]), batch)
    shared = {k: state[k] for k in SHARED if k in state}
    axes = {**dict.fromkeys(state[INNER], 0), **dict.fromkeys(shared)}  # the groups' own parts are mapped, the shared ones not
    new_inner, metrics = jax.vmap(train_step, in_axes=(axes, 0), spmd_axis_name=DILOCO_AXIS)({**state[INNER], **shared}, grouped)
    new_step = state["step"] + 1
    for key in shared:
      new_inner.pop(key)
    new_state = dict(state, step=new_step, **{INNER: new_inner})
    new_state = jax.lax.cond(new_step % period == 0, sync, lambda s: s, new_state)
    return new_state, metrics

  return step


SUMMED_METRICS = ("total_weights", "moe_dropped_tokens")  # counts: over all groups; every other metric is the groups' mean


def host_metrics(metrics: dict[str, Any]) -> dict[str, float]:
  """A step's fetched metrics as floats: DiLoCo's per-group values ([G]) summed (counts) or averaged; plain scalars as they are."""
  return {k: float(np.sum(v) if k in SUMMED_METRICS else np.mean(v)) for k, v in metrics.items()}


def restart_groups(state: dict, shardings: Any) -> dict:
  """state with every group's parameters set to the global ones (after load_parameters_path replaced those)."""

  def restart(s: dict) -> dict:
    inner = dict(s[INNER], params=jax.tree.map(lambda p, x: jnp.broadcast_to(p, x.shape), s["params"], s[INNER]["params"]))
    return dict(s, **{INNER: inner})

  return jax.jit(restart, out_shardings=shardings, donate_argnums=0)(state)
