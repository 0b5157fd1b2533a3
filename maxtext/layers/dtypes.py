"""Config dtype and precision names -> JAX objects."""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PRECISIONS = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH, "highest": jax.lax.Precision.HIGHEST}


def dtype(name: str) -> jnp.dtype:
  return jnp.dtype(DTYPES[name])


def precision(name: str) -> jax.lax.Precision:
  return PRECISIONS[name]
