"""Token embedding; `attend` reuses it as the output projection (tied logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Embed(nnx.Module):
  def __init__(
    self,
    vocab_size: int,
    dim: int,
    *,
    dtype: jnp.dtype,
    weight_dtype: jnp.dtype,
    precision: jax.lax.Precision,
    rngs: nnx.Rngs,
    init_std: float = 1.0,
  ):
    self.dtype = dtype
    self.precision = precision
    table = init_std * jax.random.normal(rngs.params(), (vocab_size, dim), jnp.float32)
    self.embedding = nnx.Param(table.astype(weight_dtype), logical_axes=("vocab", "embed"))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """x [..., dim] -> logits [..., vocab] against the embedding table."""
    return jnp.einsum("...e,ve->...v", x.astype(self.dtype), self.embedding[...].astype(self.dtype), precision=self.precision)
