"""Residual connections around each sub-block; the seam where mHC replaces the plain residual.

A connection takes the residual stream state and a branch function F and returns the
new state. The plain residual keeps one stream [B, S, E] and returns x + F(x). With
mhc_expansion_rate n > 1 the state is n streams [B, S, n, E] and each connection is a
manifold-constrained hyper-connection (maxtext.layers.mhc).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from maxtext.config import MaxTextConfig
from maxtext.layers import mhc
from maxtext.layers.dtypes import dtype

Branch = Callable[[jax.Array], jax.Array]


class Residual(nnx.Module):
  """x + F(x): the ordinary residual connection (no parameters)."""

  def __call__(self, x: jax.Array, branch: Branch) -> jax.Array:
    return x + branch(x)


def make_connection(config: MaxTextConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """The connection each sub-block uses under this config (mHC init is deterministic: rngs unused)."""
  del rngs
  n = config.mhc_expansion_rate
  if n == 1:
    return Residual()
  return mhc.HyperConnection(n, config.emb_dim, config.sinkhorn_iterations, weight_dtype=dtype(config.weight_dtype))


def expand_streams(x: jax.Array, config: MaxTextConfig) -> jax.Array:
  """Embedding output [B, S, E] -> residual stream state before the first layer ([B, S, n, E] for n > 1)."""
  return x if config.mhc_expansion_rate == 1 else mhc.expand(x, config.mhc_expansion_rate)


def collapse_streams(x: jax.Array, config: MaxTextConfig) -> jax.Array:
  """Residual stream state after the last layer -> [B, S, E] for the final norm (the streams summed, / n)."""
  return x if config.mhc_expansion_rate == 1 else mhc.collapse(x)
