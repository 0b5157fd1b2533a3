"""Flat '/'-joined parameter dicts <-> nnx models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from maxtext import models
from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError, shorten
from maxtext.layers import quantization
from maxtext.layers.lora import LoRAParam
from maxtext.layers.mhc import MHCParam
from maxtext.platform import Policy

ADDED_PARAMS = (LoRAParam, MHCParam)  # parameters model_from_flat initialises when flat lacks them


def path_str(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def flat_params(model_or_state: nnx.Module | nnx.State) -> dict[str, jax.Array]:
  """Every variable of a model (or state) by path."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
  return {path_str(path): v[...] for path, v in nnx.to_flat_state(state)}


def _init_added(config: MaxTextConfig, paths: list[tuple]) -> dict[tuple, jax.Array]:
  """Seeded initial values of LoRA adapters and mHC connectors (parameters a base checkpoint cannot have)."""
  if not paths:
    return {}
  wanted = set(paths)

  @jax.jit
  def init() -> dict[tuple, jax.Array]:  # only the requested arrays are computed (the rest is dead code)
    state = nnx.state(models.build(config, nnx.Rngs(config.init_weights_seed)), ADDED_PARAMS)
    return {p: v[...] for p, v in nnx.to_flat_state(state) if p in wanted}

  return init()


def _quantize_stored(config: MaxTextConfig, flat: dict[str, np.ndarray], expected: dict[tuple, nnx.Variable]) -> dict[str, np.ndarray]:
  """flat with the float kernels of kernels the model stores quantized replaced by their values and scales."""
  scales = [p for p, v in expected.items() if isinstance(v, quantization.KernelScale) and path_str(p) not in flat]
  if not scales:
    return flat
  recipe, out = quantization.recipe(config), dict(flat)
  kernels = {path: path_str(quantization.kernel_path(path)) for path in scales}
  kernels = {path: kernel for path, kernel in kernels.items() if kernel in flat}

  @jax.jit  # one compiled function for every kernel (eager, each op of each shape compiles on its own)
  def quantize(floats: dict[str, jax.Array]) -> dict[str, tuple[jax.Array, jax.Array]]:
    return {kernel: quantization.quantize_like(floats[kernel], expected[path], recipe) for path, kernel in kernels.items()}

  quantized = quantize({kernel: jnp.asarray(flat[kernel]) for kernel in kernels.values()})
  for path, kernel in kernels.items():
    out[kernel], out[path_str(path)] = quantized[kernel]
  return out


def model_from_flat(config: MaxTextConfig, flat: dict[str, np.ndarray], mesh: Mesh | None = None, policy: Policy | None = None) -> models.Transformer:
  """Build the config's model (of `policy`; default: the local platform's) and assign every parameter from flat (cast
  to weight_dtype, sharded over mesh if given).

  LoRA adapters and mHC connectors that flat lacks (e.g. it came from a Hugging Face checkpoint) get their
  seeded init, which leaves the model's outputs unchanged; every other parameter must be in flat. Float kernels of
  a model that stores them quantized (QLoRA, decoding with `quantization`) are quantized here.
  """
  graphdef, abstract = nnx.split(models.abstract_model(config, policy))
  shardings = models.state_shardings(abstract, config, mesh) if mesh is not None else None
  sharding_by_path = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  expected = dict(nnx.to_flat_state(abstract))
  flat = _quantize_stored(config, flat, expected)
  names = {path_str(p): p for p in expected}
  missing = sorted(set(names) - set(flat))
  initialised = _init_added(config, [names[n] for n in missing if isinstance(expected[names[n]], ADDED_PARAMS)])
  missing = [n for n in missing if names[n] not in initialised]
  unexpected = sorted(set(flat) - set(names))
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f"missing {shorten(missing)}")
    if unexpected:
      parts.append(f"unexpected {shorten(unexpected)}")
    raise ConfigError(f"parameters do not match the model of this config: {'; '.join(parts)}")
  leaves = []
  for name, path in names.items():
    var = expected[path]
    if path in initialised:
      array = initialised[path]
      leaves.append((path, var.replace(jax.device_put(array, sharding_by_path[path]) if path in sharding_by_path else array)))
      continue
    value = flat[name]
    if tuple(value.shape) != tuple(var.shape):
      raise ConfigError(f"parameter '{name}' has shape {tuple(value.shape)} but the config's model needs {tuple(var.shape)}; check the config")
    array = jnp.asarray(value, dtype=var.dtype)
    if path in sharding_by_path:
      array = jax.device_put(array, sharding_by_path[path])
    leaves.append((path, var.replace(array)))
  return nnx.merge(graphdef, nnx.from_flat_state(leaves))
