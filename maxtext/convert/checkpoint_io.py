"""maxtext params checkpoints (Orbax, as load_parameters_path reads them) <-> flat parameter dicts, and one adapter
slot of a multi-adapter model's flat parameters <-> the parameters of a one-adapter model."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext import mesh as mesh_lib
from maxtext import models
from maxtext.config import MaxTextConfig
from maxtext.config.adapters import is_adapter_path, slot_axis, slot_index
from maxtext.convert.model_params import flat_params
from maxtext.errors import ConfigError
from maxtext.train import checkpoint_files


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def save(path: str | Path, model: nnx.Module) -> None:
  """Write the model's parameters as a params-only checkpoint usable as load_parameters_path."""
  checkpoint_files.save_params(str(Path(path).absolute()), nnx.state(model, nnx.Param))


def load_flat(path: str | Path, config: MaxTextConfig) -> dict[str, np.ndarray]:
  """Parameters of a params or full-state checkpoint, restored for the config's model, as flat numpy arrays."""
  mesh = mesh_lib.create(config)
  abstract = nnx.state(models.abstract_model(config), nnx.Param)
  shardings = models.state_shardings(abstract, config, mesh)
  target = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), abstract, shardings, is_leaf=_is_variable)
  params = checkpoint_files.restore_params(str(Path(path).absolute()), target)
  return {k: np.asarray(jax.device_get(v)) for k, v in flat_params(params).items()}


def slot_params(flat: dict[str, jax.Array], config: MaxTextConfig, name: str) -> dict[str, jax.Array]:
  """Adapter `name` of a multi-adapter model's flat '/'-path params, as the one-adapter model of
  single_adapter_config(config, name) holds it: A [..., in..., r], B [..., r, out...] (only adapter paths)."""
  slot, spec = slot_index(config, name)
  axis = slot_axis(config)
  out = {}
  for path, value in flat.items():
    if is_adapter_path(path):
      value = jnp.take(jnp.asarray(value), slot, axis=axis)
      rank_axis = value.ndim - 1 if path.endswith("lora_a") else axis
      out[path] = jax.lax.slice_in_dim(value, 0, spec.rank, axis=rank_axis)
  return out


def put_slot(flat: dict[str, jax.Array], adapter: dict[str, jax.Array], config: MaxTextConfig, name: str) -> dict[str, jax.Array]:
  """flat with slot `name` replaced by a one-adapter model's adapters (as slot_params gives them), zero-padded to max_lora_rank."""
  slot, spec = slot_index(config, name)
  axis = slot_axis(config)
  out = dict(flat)
  for path, value in adapter.items():
    value = jnp.asarray(value)
    rank_axis = value.ndim - 1 if path.endswith("lora_a") else axis
    if value.shape[rank_axis] != spec.rank:
      raise ConfigError(f"adapter for slot '{name}' has rank {value.shape[rank_axis]} at {path}; the slot's rank is {spec.rank}")
    full = jnp.asarray(flat[path])
    pad = [(0, 0)] * value.ndim
    pad[rank_axis] = (0, full.shape[axis + 1 if path.endswith("lora_b") else -1] - spec.rank)
    padded = jnp.pad(value, pad).astype(full.dtype)
    out[path] = full.at[(slice(None),) * axis + (slot,)].set(padded)
  return out
