"""DenseGeneral: a linear map over trailing input axes to an output shape, with an optional LoRA adapter and quantization."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.layers import matmul, quantization

if TYPE_CHECKING:
  from maxtext.platform import Policy


def variance_scaling_init(key: jax.Array, shape: Sequence[int], fan_in: int, dtype: jnp.dtype) -> jax.Array:
  """Truncated-normal init with variance 1/fan_in (MaxText's default kernel init)."""
  std = 1.0 / math.sqrt(fan_in) / 0.87962566103423978  # stddev of a unit normal truncated to [-2, 2]
  return (jax.random.truncated_normal(key, -2.0, 2.0, tuple(shape), jnp.float32) * std).astype(dtype)


def dense_kwargs(policy: Policy, rngs: nnx.Rngs) -> dict[str, Any]:
  """DenseGeneral's keyword arguments from the policy's dtypes, matmul precision and numerics."""
  return dict(
    dtype=policy.dtypes.compute,
    weight_dtype=policy.dtypes.params,
    precision=policy.dtypes.precision,
    rngs=rngs,
    integer_rounding=policy.integer_bf16_rounding,
    quant=policy.quantization,
  )


class DenseGeneral(nnx.Module):
  """y = x . kernel, contracting the last len(in_shape) axes of x.

  kernel has shape in_shape + out_shape and logical axes `logical_axes`; use_bias adds a bias of out_shape
  (zeros at init). `lora` is an optional adapter module (see maxtext.layers.lora) added to the output; the call's
  adapter_ids ([B] or [B, S], or None) pick each row's adapter slot when it holds several.
  `quant` (maxtext.layers.quantization) quantizes the product; with `quant.stored` the kernel holds the quantized
  values and `kernel_scale` their scales.
  """

  def __init__(
    self,
    in_shape: Sequence[int],
    out_shape: Sequence[int],
    logical_axes: Sequence[str | None],
    *,
    dtype: jnp.dtype,
    weight_dtype: jnp.dtype,
    precision: jax.lax.Precision,
    rngs: nnx.Rngs,
    integer_rounding: bool = False,
    use_bias: bool = False,
    quant: quantization.Recipe | None = None,
  ):
    self.in_shape = tuple(in_shape)
    self.out_shape = tuple(out_shape)
    self.dtype = dtype
    self.precision = precision
    self.integer_rounding = integer_rounding  # the platform policy's bf16 rounding (maxtext.layers.dtypes.cast)
    self.quant = quant
    shape = self.in_shape + self.out_shape
    kernel = variance_scaling_init(rngs.params(), shape, math.prod(self.in_shape), weight_dtype)
    if quant is not None and quant.stored:
      values, scale = quantization.quantize_kernel(kernel, len(self.in_shape), quant)
      self.kernel = nnx.Param(values, logical_axes=tuple(logical_axes))
      axes = quantization.scale_axes(logical_axes, shape, len(self.in_shape), quant.weight)
      self.kernel_scale = quantization.KernelScale(scale, logical_axes=axes, in_axes=len(self.in_shape), out_axes=len(self.out_shape))
    else:
      self.kernel = nnx.Param(kernel, logical_axes=tuple(logical_axes))
      self.kernel_scale = None
    out_axes = tuple(logical_axes)[len(self.in_shape) :]
    self.bias = nnx.Param(jnp.zeros(self.out_shape, weight_dtype), logical_axes=out_axes) if use_bias else None
    self.lora: nnx.Module | None = None

  def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> jax.Array:
    n_in = len(self.in_shape)
    if self.quant is None:
      y = matmul.contract_trailing(x, self.kernel[...], n_in, dtype=self.dtype, precision=self.precision, integer_rounding=self.integer_rounding)
    elif self.kernel_scale is not None:
      spec = quantization.trailing_spec(x.ndim, n_in, len(self.out_shape))
      y = quantization.stored_einsum(spec, x, self.kernel[...], self.kernel_scale[...], self.quant, self.dtype)
    else:
      y = quantization.einsum(quantization.trailing_spec(x.ndim, n_in, len(self.out_shape)), x, self.kernel[...], self.quant, self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(y.dtype)
    if self.lora is not None:
      y = y + self.lora(x, adapter_ids).astype(y.dtype)
    return y
