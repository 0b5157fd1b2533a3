"""The train state: a plain dict pytree, sharded by the logical axes each parameter carries.

    {"step": int32[],                 optimizer steps taken
     "params": nnx.State,             every nnx.Param of the model (trainable and frozen)
     "opt_state": optax state,        over the trainable subset only
     "spike": {"losses", "count"},    only with skip_step_on_spikes
     "other": nnx.State,              only if the model holds non-Param variables
     "reference": nnx.State}          only for DPO/GRPO: frozen initial parameters (maxtext.train.reference)

Trainable parameters are the subset of "params" that `maxtext.train.trainable.trainable_filter(config)` selects;
the rest stay frozen (LoRA marks its adapters here). Checkpoints store this dict as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtext import mesh as mesh_lib
from maxtext.config import MaxTextConfig
from maxtext.train import reference
from maxtext.train.trainable import split_params

TrainState = dict[str, Any]
DATA_AXIS = "data"  # the mesh axis of data parallelism (shard_optimizer_over_data splits the optimizer state over it)
HOST_MEMORY = "pinned_host"  # the memory kind of state kept off the device between steps (optimizer_memory_host_offload)


def checkpointed(state: TrainState, config: MaxTextConfig) -> TrainState:
  """The part of a train state (or abstract state) that checkpoints hold.

  All of it, except that a LoRA run leaves out its frozen base parameters and a DPO/GRPO run its frozen reference:
  they come back from load_parameters_path (or the seeded init) when the run resumes.
  """
  if reference.KEY in state:
    state = {k: v for k, v in state.items() if k != reference.KEY}
  if not config.lora.enable_lora:
    return state
  return dict(state, params=split_params(state["params"], config)[0])


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def shardings(tree: Any, config: MaxTextConfig, mesh: Mesh) -> Any:
  """NamedSharding for every leaf: from a Variable's logical_axes, else replicated."""
  replicated = NamedSharding(mesh, PartitionSpec())

  def one(path: tuple, x: Any) -> Any:
    if _is_variable(x) and not hasattr(x.get_value(), "shape"):  # e.g. optax's MaskedNode: no arrays inside
      return x
    if _is_variable(x):
      axes = getattr(x, "logical_axes", None)
      name = "train state " + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
      return x.replace(value=mesh_lib.checked_logical_sharding(axes, x.get_value().shape, config, mesh, name) if axes else replicated)
    return replicated

  return jax.tree.map_with_path(one, tree, is_leaf=_is_variable)


def train_state_shardings(abstract: TrainState, config: MaxTextConfig, mesh: Mesh) -> TrainState:
  """The train state's shardings: each Variable's logical axes (`shardings`), then the optimizer state split over
  the data axis too (shard_optimizer_over_data) and kept in host memory (optimizer_memory_host_offload)."""
  tree = shardings(abstract, config, mesh)
  if config.shard_optimizer_over_data:
    tree = dict(tree, opt_state=jax.tree.map(lambda s, a: mesh_lib.over_axis(s, a.shape, DATA_AXIS), tree["opt_state"], abstract["opt_state"]))
  return offload_optimizer(tree, config)


def offload_optimizer(shardings_tree: TrainState, config: MaxTextConfig) -> TrainState:
  """The state's shardings with the optimizer state in pinned host memory (optimizer_memory_host_offload), else as given."""
  if not config.optimizer_memory_host_offload:
    return shardings_tree
  return dict(shardings_tree, opt_state=jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings_tree["opt_state"]))


def on_device(shardings_tree: Any) -> Any:
  """shardings_tree with every sharding in device memory (where a host-held part of the state is computed on)."""
  return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings_tree)


def with_shardings(abstract: Any, shardings_tree: Any) -> Any:
  """ShapeDtypeStructs that carry their sharding (what AOT lowering and Orbax restore want)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings_tree)


def step_formats(shardings_tree: Any, compiler_layouts: bool) -> Any:
  """What the train step's jit takes and returns the state in: the shardings, with device layouts left to XLA
  when compiler_layouts (the platform policy's `compiler_state_layouts`)."""
  if not compiler_layouts:
    return shardings_tree
  return jax.tree.map(lambda s: Format(Layout.AUTO, s), shardings_tree)


def compiled_formats(step_fn: Any) -> Any:
  """The formats (sharding and device layout) of the state a compiled train step takes: those of the state it
  returns, which the next step takes (the donated state is updated in place). Read from the outputs because
  jax's `input_formats` miscounts when the step has hoisted constants or unused inputs."""
  return step_fn.output_formats[0]


def placed(state: TrainState, formats: Any) -> TrainState:
  """state in formats: each array whose layout or sharding differs is moved there and its old buffer freed,
  one array at a time (a restored checkpoint arrives in default layouts)."""

  def one(x: Any, fmt: Any) -> Any:
    return x if x.format == fmt else jax.device_put(x, fmt, donate=True)

  return jax.tree.map(one, state, formats)


def make_init_fn(config: MaxTextConfig, build_model: Callable[..., nnx.Module], optimizer: Any, seed: int) -> Callable[[], TrainState]:
  """A pure function creating the initial train state (jit it with out_shardings to create it sharded)."""

  def init() -> TrainState:
    model = build_model(config, nnx.Rngs(seed))
    _, params, other = nnx.split(model, nnx.Param, ...)
    trainable, _ = split_params(params, config)
    state: TrainState = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(trainable)}
    if config.skip_step_on_spikes:
      state["spike"] = {"losses": jnp.zeros((config.skip_step_interval,), jnp.float32), "count": jnp.zeros((), jnp.int32)}
    if jax.tree.leaves(other):
      state["other"] = other
    if reference.stores_copy(config, params):
      state[reference.KEY] = reference.initial(config, params)
    return state

  return init
