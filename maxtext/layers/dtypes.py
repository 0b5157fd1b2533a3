"""Dtype and precision names -> JAX objects (for code outside the model: the model's come resolved in
maxtext.platform.Dtypes), and the dtype cast the layers use."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from maxtext.platform import DTYPES

PRECISIONS = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH, "highest": jax.lax.Precision.HIGHEST}


def dtype(name: str) -> jnp.dtype:
  return jnp.dtype(DTYPES[name])


def precision(name: str) -> jax.lax.Precision:
  return PRECISIONS[name]


def bits(dt: Any) -> int:
  """Bits per element (int4: 4; TPUs and GPUs pack two per byte)."""
  dt = jnp.dtype(dt)
  return jnp.iinfo(dt).bits if jnp.issubdtype(dt, jnp.integer) else jnp.finfo(dt).bits if jnp.issubdtype(dt, jnp.floating) else 8 * dt.itemsize


def cast(x: jax.Array, to: jnp.dtype, integer_rounding: bool = False) -> jax.Array:
  """x.astype(to). With integer_rounding (the CPU policy's `integer_bf16_rounding`, maxtext.platform), float32 ->
  bfloat16 rounds with integer ops: XLA:CPU's fused float conversion is slower than the arithmetic around it, and
  the output head's backward pass is mostly such casts (figures: benchmarks/README.md, figures behind code comments)."""
  if integer_rounding and x.dtype == jnp.float32 and jnp.dtype(to) == jnp.bfloat16:
    return round_to_bfloat16(x)
  return x.astype(to)


@jax.custom_jvp
def round_to_bfloat16(x: jax.Array) -> jax.Array:
  """float32 -> bfloat16, round to nearest even (bit-identical to astype); NaN becomes the canonical NaN.

  Differentiates as astype: the tangent is cast, so the backward pass converts cotangents to float32.
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) >> 16
  rounded = jnp.where(jnp.isnan(x), jnp.uint32(0x7FC0), rounded)  # in integers: a float select would convert back
  return jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)


@round_to_bfloat16.defjvp
def _round_to_bfloat16_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
  return round_to_bfloat16(primals[0]), tangents[0].astype(jnp.bfloat16)
