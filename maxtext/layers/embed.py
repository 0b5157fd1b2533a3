"""Token embedding (with tied logits, maxtext.models.decoder also uses its table as the output kernel)."""

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
    rngs: nnx.Rngs,
    init_std: float = 1.0,
  ):
    self.dtype = dtype
    table = init_std * jax.random.normal(rngs.params(), (vocab_size, dim), jnp.float32)
    self.embedding = nnx.Param(table.astype(weight_dtype), logical_axes=("vocab", "embed"))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
