"""maxtext params checkpoints (Orbax, as load_parameters_path reads them) <-> flat parameter dicts."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from maxtext import mesh as mesh_lib
from maxtext import models
from maxtext.config import MaxTextConfig
from maxtext.convert.model_params import flat_params
from maxtext.train import checkpointing


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def save(path: str | Path, model: nnx.Module) -> None:
  """Write the model's parameters as a params-only checkpoint usable as load_parameters_path."""
  checkpointing.save_params(str(Path(path).absolute()), nnx.state(model, nnx.Param))


def load_flat(path: str | Path, config: MaxTextConfig) -> dict[str, np.ndarray]:
  """Parameters of a params or full-state checkpoint, restored for the config's model, as flat numpy arrays."""
  mesh = mesh_lib.create(config)
  abstract = nnx.state(models.abstract_model(config), nnx.Param)
  shardings = models.state_shardings(abstract, config, mesh)
  target = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), abstract, shardings, is_leaf=_is_variable)
  params = checkpointing.restore_params(str(Path(path).absolute()), target)
  return {k: np.asarray(jax.device_get(v)) for k, v in flat_params(params).items()}
