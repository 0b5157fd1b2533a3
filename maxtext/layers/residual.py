"""Residual connections around each sub-block; the seam where mHC replaces the plain residual.

A connection takes the residual stream state and a branch function F and returns the
new state. The plain residual keeps one stream [B, S, E] and returns x + F(x).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from maxtext.config import MaxTextConfig

Branch = Callable[[jax.Array], jax.Array]


class Residual(nnx.Module):
  """x + F(x): the ordinary residual connection (no parameters)."""

  def __call__(self, x: jax.Array, branch: Branch) -> jax.Array:
    return x + branch(x)


def make_connection(config: MaxTextConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """The connection each sub-block uses under this config."""
  del rngs
  return Residual()


def expand_streams(x: jax.Array, config: MaxTextConfig) -> jax.Array:
  """Embedding output -> residual stream state before the first layer."""
  return x


def collapse_streams(x: jax.Array, config: MaxTextConfig) -> jax.Array:
  """Residual stream state after the last layer -> [B, S, E] for the final norm."""
  return x
