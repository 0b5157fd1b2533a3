"""Einsums in a compute dtype that accumulate in float32, forward and backward.

`einsum(spec, a, b, dtype=bf16)` casts both operands to bf16, multiplies them with float32
accumulation and returns `out_dtype`. Its gradients are the two transposed einsums, again bf16
operands with float32 accumulation, each returned in its operand's dtype, so a float32 weight gets
a float32 gradient that was never rounded to bf16.

Plain autodiff of `jnp.einsum(..., preferred_element_type=float32).astype(bf16)` would instead
feed a float32 cotangent against a bf16 operand, which promotes the gradient matmuls to float32;
and a bf16-output einsum is what XLA:CPU runs by upcasting to float32, far slower than its bf16
matmul units (figure: benchmarks/README.md, figures behind code comments). Accelerators accumulate
in float32 either way.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from maxtext.layers.dtypes import cast


def einsum(
  spec: str,
  a: jax.Array,
  b: jax.Array,
  *,
  dtype: Any,
  precision: jax.lax.Precision | None = None,
  out_dtype: Any = None,
  integer_rounding: bool = False,
) -> jax.Array:
  """jnp.einsum(spec, a, b) on dtype-cast operands with float32 accumulation, returned in out_dtype (default: dtype).

  spec is "A,B->C" where every index of A and of B also appears in the other operand or in C.
  integer_rounding: the platform policy's float32 -> bfloat16 rounding (maxtext.layers.dtypes.cast).
  """
  inputs, out = spec.split("->")
  lhs, rhs = inputs.split(",")
  out_dtype = dtype if out_dtype is None else out_dtype
  a_dtype, b_dtype = a.dtype, b.dtype

  def forward(a, b):
    a_c, b_c = a.astype(dtype), b.astype(dtype)
    return cast(product(spec, a_c, b_c, precision), out_dtype, integer_rounding), (a_c, b_c)

  def backward(residuals, g):
    a_c, b_c = residuals
    g = g.astype(dtype)
    d_a = cast(product(f"{out},{rhs}->{lhs}", g, b_c, precision), a_dtype, integer_rounding)
    d_b = cast(product(f"{lhs},{out}->{rhs}", a_c, g, precision), b_dtype, integer_rounding)
    return d_a, d_b

  fn = jax.custom_vjp(lambda a, b: forward(a, b)[0])
  fn.defvjp(forward, backward)
  return fn(a, b)


def product(spec: str, x: jax.Array, y: jax.Array, precision: jax.lax.Precision | None = None) -> jax.Array:
  """jnp.einsum with float32 accumulation and a float32 result (no casts, no custom gradient)."""
  return jnp.einsum(spec, x, y, precision=precision, preferred_element_type=jnp.float32)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def contract_trailing(
  x: jax.Array, w: jax.Array, n: int, *, dtype: Any, precision: jax.lax.Precision | None = None, integer_rounding: bool = False
) -> jax.Array:
  """einsum of x's last n axes with w's first n axes: [..., *in] x [*in, *out] -> [..., *out]."""
  contracted, produced = _LETTERS[:n], _LETTERS[n : w.ndim]
  spec = f"...{contracted},{contracted}{produced}->...{produced}"
  return einsum(spec, x, w, dtype=dtype, precision=precision, integer_rounding=integer_rounding)
