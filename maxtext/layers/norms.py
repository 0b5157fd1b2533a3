"""RMSNorm, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x / rms(x) * scale; with zero_centered (Gemma) the stored scale s is applied as (1 + s)."""

  def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, weight_dtype: jnp.dtype, zero_centered: bool = False, logical_axis: str = "norm"):
    self.eps = eps
    self.dtype = dtype
    self.zero_centered = zero_centered
    init = jnp.zeros if zero_centered else jnp.ones
    self.scale = nnx.Param(init((dim,), weight_dtype), logical_axes=(logical_axis,))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    if self.zero_centered:
      scale = 1.0 + scale
    return (y * scale).astype(self.dtype)
