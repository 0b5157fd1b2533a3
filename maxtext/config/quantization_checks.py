"""Cross-field checks of the quantization keys, and the fp8 calibration methods' syntax."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from maxtext.config.model_shape import mixers
from maxtext.errors import ConfigError, echo
from maxtext.quantization_recipe import QUANTIZATION_CALIBRATION_KEYS

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig


GRADIENT_QUANTIZED = ("fp8", "fp8_full")  # modes whose backward products quantize the incoming gradient


def check_quantization(c: MaxTextConfig) -> None:
  """Cross-field checks of the quantization keys (one-line ConfigErrors)."""
  for key in QUANTIZATION_CALIBRATION_KEYS:
    value = getattr(c, key)
    problem = calibration_problem(value)
    if problem:
      raise ConfigError(f"invalid value for '{key}': {echo(value)} {problem}; use absmax, absmax,<c> or rms,<c> (c > 0), fixed,<c> or fixed,-<c>,<c>")
    if value != "absmax" and c.quantization != "fp8_full":
      raise ConfigError(f"{key}={value} applies to quantization=fp8_full (int8, fp8 and int4w scale by absmax each step); set quantization=fp8_full or drop it")
  shards = c.quantization_local_shard_count
  if shards == 0 or shards < -1:
    raise ConfigError(f"invalid value for 'quantization_local_shard_count': {shards}; use -1 (one per slice) or a positive number")
  if shards != -1 and (not c.quantization or c.quantization not in GRADIENT_QUANTIZED):
    raise ConfigError(
      f"quantization_local_shard_count={shards} tiles the quantized weight gradients of fp8 and fp8_full; "
      f"quantization='{c.quantization}' keeps gradients in {c.dtype}: drop it"
    )
  if c.quantize_logits_proj and c.quantization in ("", "int4w"):
    raise ConfigError(
      f"quantize_logits_proj=true quantizes the output projection's weights and activations; quantization='{c.quantization}' does not (use int8, fp8 or fp8_full)"
    )
  if c.checkpoint_is_quantized and not (c.quantization and c.load_parameters_path):
    raise ConfigError(
      "checkpoint_is_quantized=true loads quantized kernels from load_parameters_path; set load_parameters_path and the quantization they were saved with"
    )
  if c.save_quantized_params_path and not c.quantization:
    raise ConfigError("save_quantized_params_path writes kernels quantized per `quantization`, which is off; set quantization=int8, fp8, fp8_full or int4w")
  if c.quantize_kvcache:
    if not c.kv_quant_axis:
      raise ConfigError("quantize_kvcache=true needs kv_quant_axis=dkv or heads_and_dkv (the axes one scale covers); set it")
    if c.kv_quant_dtype == "int4" and c.head_dim % 2:
      raise ConfigError(f"kv_quant_dtype=int4 stores two values per byte along head_dim, which is odd ({c.head_dim}); use kv_quant_dtype=int8")
    if {"mla", "mla_sparse"} & mixers(c):
      raise ConfigError(
        f"quantize_kvcache=true quantizes keys and values per kv head; decoder_block={c.decoder_block} (MLA) caches a compressed latent,"
        " which stays in the compute dtype here; drop quantize_kvcache"
      )


def calibration_problem(method: str) -> str | None:
  """What is wrong with a qwix calibration method for fp8 ('absmax', 'absmax,c', 'rms,c', 'fixed,c', 'fixed,lo,hi'), or None.

  Every factor is a finite number > 0 (qwix takes absmax,-3 and scales by a negative or zero absmax, which it quietly
  replaces by 1); a fixed range holds 0 and is symmetric, since fp8 has no zero point (qwix refuses others mid-run)."""
  name, *args = method.split(",")
  try:
    numbers = [float(a) for a in args]
  except ValueError:
    return "has a factor that is not a number"
  counts = {"absmax": (0, 1), "rms": (1,), "fixed": (1, 2)}
  if name not in counts:
    return "is not a calibration method"
  if len(numbers) not in counts[name]:
    return f"gives {name} {len(numbers)} factors"
  if not all(math.isfinite(x) for x in numbers):
    return "has a factor that is not finite"
  if name != "fixed" or len(numbers) == 1:
    return None if all(x > 0 for x in numbers) else "has a factor that is not > 0"
  lo, hi = numbers
  return None if lo == -hi and hi > 0 else f"is not a range [-c, c] around 0 (fp8 scales are symmetric: {lo} .. {hi})"


def check_quantization_tiles(config: MaxTextConfig, tiles: int) -> None:
  """The weight gradient's token axis (each row's max_target_length tokens) must split into `tiles` equal tiles."""
  if tiles > 1 and config.max_target_length % tiles:
    raise ConfigError(
      f"quantization_local_shard_count {tiles} must divide max_target_length {config.max_target_length} (the weight gradient's token axis); pick a divisor"
    )
