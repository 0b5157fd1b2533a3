"""Decoder models: build them, create them already sharded, and map their parameters to shardings.

The layers load on first use (`Transformer`, `build`, ...), so the config can read the family registry
(`maxtext.models.registry`) without pulling in any layer code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from maxtext import platform
from maxtext.config import MaxTextConfig
from maxtext.mesh import checked_logical_sharding
from maxtext.platform import Policy

if TYPE_CHECKING:
  from maxtext.models.decoder import Transformer

__all__ = ["Transformer", "abstract_model", "build", "create_sharded", "logical_axes", "state_shardings"]


def build(config: MaxTextConfig, rngs: nnx.Rngs | None = None, policy: Policy | None = None) -> Transformer:
  """The model with freshly initialised parameters on the default device (small models, tests).

  policy defaults to the local devices' (maxtext.platform.resolve); setup passes the target mesh's.
  """
  from maxtext.models.decoder import Transformer
  from maxtext.models.specs import decoder

  policy = policy or platform.resolve(config)
  return Transformer(decoder(config), policy=policy, rngs=rngs or nnx.Rngs(config.init_weights_seed))


def abstract_model(config: MaxTextConfig, policy: Policy | None = None) -> Transformer:
  """The model with ShapeDtypeStruct parameters: no memory allocated."""
  from maxtext.models.decoder import Transformer
  from maxtext.models.specs import decoder

  policy, spec = policy or platform.resolve(config), decoder(config)
  return nnx.eval_shape(lambda: Transformer(spec, policy=policy, rngs=nnx.Rngs(config.init_weights_seed)))


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def logical_axes(state: nnx.State) -> nnx.State:
  """Pytree of each variable's logical axis names (None where a variable has none)."""
  return jax.tree.map(lambda v: v.get_metadata().get("logical_axes"), state, is_leaf=_is_variable)


def state_shardings(state: nnx.State, config: MaxTextConfig, mesh: Mesh) -> nnx.State:
  """Pytree of NamedSharding matching state, from logical axes and config.logical_axis_rules.

  A dimension the mapped mesh axes do not divide is a one-line ConfigError.
  """

  def one(path: tuple, v: nnx.Variable) -> NamedSharding:
    name = "parameter " + "/".join(str(getattr(k, "key", k)) for k in path)
    return checked_logical_sharding(v.get_metadata().get("logical_axes"), v.shape, config, mesh, name)

  return jax.tree.map_with_path(one, state, is_leaf=_is_variable)


def create_sharded(config: MaxTextConfig, mesh: Mesh, seed: int | None = None, policy: Policy | None = None) -> Transformer:
  """Initialise the model with every parameter born sharded (no full host copy); policy defaults to the mesh's."""
  from maxtext.models.decoder import Transformer
  from maxtext.models.specs import decoder

  seed = config.init_weights_seed if seed is None else seed
  spec = decoder(config)
  policy = policy or platform.resolve(config, mesh)
  graphdef, abstract_state = nnx.split(abstract_model(config, policy))
  shardings = state_shardings(abstract_state, config, mesh)

  @jax.jit
  def init() -> nnx.State:
    return nnx.state(Transformer(spec, policy=policy, rngs=nnx.Rngs(seed)))

  with jax.set_mesh(mesh):
    state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


def sharding_tree(model: Transformer) -> dict[str, NamedSharding]:
  """Current sharding of every parameter, by path (for inspection and tests)."""
  return {"/".join(map(str, path)): v[...].sharding for path, v in nnx.to_flat_state(nnx.state(model))}


def __getattr__(name: str):
  if name == "Transformer":
    from maxtext.models.decoder import Transformer

    return Transformer
  raise AttributeError(f"module 'maxtext.models' has no attribute {name!r}")
