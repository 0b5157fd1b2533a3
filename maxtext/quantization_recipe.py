"""The quantized-matmul recipe a run's `quantization` names, resolved for a platform: plain data the platform policy
(maxtext.platform.Policy) carries and the layers' quantized products (maxtext.layers.quantization) follow.

It sits below both, imports no JAX at load time, and reads the config keys through attribute access only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from maxtext.errors import ConfigError

# The config keys of fp8_full's calibration methods (checked by maxtext.config.derived, read by recipe below)
QUANTIZATION_CALIBRATION_KEYS = ("weight_quantization_calibration_method", "act_quantization_calibration_method", "bwd_quantization_calibration_method")
QTYPES = {"int8": "int8", "int4": "int4", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}  # format -> jax.numpy dtype name

# mode -> (weight, activation, gradient) formats; None: not quantized (weight-only, or gradients in the compute dtype)
FORMATS = {
  "int8": ("int8", "int8", None),
  "fp8": ("e4m3", "e4m3", "e5m2"),
  "fp8_full": ("e4m3", "e4m3", "e5m2"),
  "int4w": ("int4", None, None),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a run's quantized matmuls are made (config.quantization resolved for a platform; hashable, it sits in graphdefs)."""

  mode: str  # int8 | fp8 | fp8_full | int4w
  weight: str  # format of kernels: int8 | int4 | e4m3
  activation: str | None  # format of activations; None: weight-only
  gradient: str | None  # format of incoming gradients in the backward products; None: compute dtype (straight-through)
  weight_calibration: str = "absmax"
  act_calibration: str = "absmax"
  grad_calibration: str = "absmax"
  grad_tiles: int = 1  # quantization_local_shard_count: scale tiles along the weight gradient's token axis
  stored: bool = False  # kernels held quantized (values + scales) instead of quantized from float each step
  native: bool = True  # the platform's matmul units take the format; else XLA converts it to bf16 first (same numerics, no speedup)

  def storing(self) -> Recipe:
    """The same recipe with kernels held quantized."""
    return dataclasses.replace(self, stored=True)


def recipe(config: Any, native: bool = True) -> Recipe | None:
  """The recipe of config.quantization (None when off); native: whether the target's matmul units take its format.

  Kernels are stored quantized when LoRA trains on a frozen int8/int4 base (QLoRA); decoding stores them too
  (Recipe.storing). The config's calibration and tiling keys were validated when it loaded (maxtext.config.derived).
  """
  mode = config.quantization
  if not mode:
    return None
  weight, activation, gradient = FORMATS[mode]
  calibration = (
    tuple(getattr(config, key) for key in QUANTIZATION_CALIBRATION_KEYS) if mode == "fp8_full" else ("absmax",) * 3
  )  # MaxText: only fp8_full reads the calibration keys
  tiles = config.quantization_local_shard_count
  return Recipe(
    mode=mode,
    weight=weight,
    activation=activation,
    gradient=gradient,
    weight_calibration=calibration[0],
    act_calibration=calibration[1],
    grad_calibration=calibration[2],
    grad_tiles=(config.num_slices or 1) if tiles == -1 else tiles,
    stored=config.lora.enable_lora and mode in ("int8", "int4w"),
    native=native,
  )


def check_devices(r: Recipe | None, devices: Sequence[Any]) -> None:
  """fp8 needs float8 types in JAX and, on NVIDIA GPUs, compute capability 8.9 or newer (Ada, Hopper): else a one-line ConfigError."""
  if r is None or "e4m3" not in (r.weight, r.activation):
    return
  import jax  # only where devices are checked: the platform policy imports this module without JAX

  missing = [QTYPES[f] for f in ("e4m3", "e5m2") if not hasattr(jax.numpy, QTYPES[f])]
  if missing:
    raise ConfigError(f"quantization={r.mode} needs jax.numpy.{' and '.join(missing)}, which JAX {jax.__version__} lacks; upgrade jax or use int8")
  for d in devices:
    capability = getattr(d, "compute_capability", None)
    if capability and tuple(int(p) for p in str(capability).split(".")[:2]) < (8, 9):
      raise ConfigError(
        f"quantization={r.mode} needs fp8 matmul units (NVIDIA compute capability 8.9+: Ada, Hopper); {d.device_kind} has {capability}; use int8"
      )
