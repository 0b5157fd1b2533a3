"""RMSNorm, computed in float32, and the spec every norm of a model shares."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.platform import Dtypes


@dataclasses.dataclass(frozen=True)
class NormSpec:
  """What a model's RMSNorms share (maxtext.models.specs builds it)."""

  epsilon: float  # normalization_layer_epsilon
  zero_centered: bool = False  # the family stores s and applies (1 + s) (Gemma)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale; with zero_centered (Gemma) the stored scale s is applied as (1 + s)."""

  def __init__(
    self,
    dim: int,
    eps: float,
    *,
    dtype: jnp.dtype,
    weight_dtype: jnp.dtype,
    zero_centered: bool = False,
    logical_axis: str = "norm",
    with_scale: bool = True,
  ):
    self.eps = eps
    self.dtype = dtype
    self.zero_centered = zero_centered
    init = jnp.zeros if zero_centered else jnp.ones
    self.scale = nnx.Param(init((dim,), weight_dtype), logical_axes=(logical_axis,)) if with_scale else None  # None: x / rms(x) only

  @classmethod
  def of(cls, dim: int, spec: NormSpec, dtypes: Dtypes, logical_axis: str = "norm", zero_centered: bool | None = None, with_scale: bool = True) -> RMSNorm:
    """A norm over dim features as spec and dtypes say (zero_centered overrides the spec's: MLA's norms never are)."""
    zc = spec.zero_centered if zero_centered is None else zero_centered
    return cls(dim, spec.epsilon, dtype=dtypes.compute, weight_dtype=dtypes.params, zero_centered=zc, logical_axis=logical_axis, with_scale=with_scale)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.scale is None:
      return y.astype(self.dtype)
    scale = self.scale[...].astype(jnp.float32)
    if self.zero_centered:
      scale = 1.0 + scale
    return (y * scale).astype(self.dtype)
