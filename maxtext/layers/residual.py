"""Residual connections around each sub-block; the seam where mHC replaces the plain residual.

A connection takes the residual stream state and a branch function F and returns the
new state. The plain residual keeps one stream [B, S, E] and returns x + F(x). With
mhc_expansion_rate n > 1 the state is n streams [B, S, n, E] and each connection is a
manifold-constrained hyper-connection (maxtext.layers.mhc).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from flax import nnx

from maxtext.layers import mhc
from maxtext.platform import Dtypes

Branch = Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class ResidualSpec:
  """The residual stream (maxtext.models.specs builds it)."""

  emb_dim: int
  streams: int = 1  # mhc_expansion_rate: 1 is the plain residual, n > 1 mHC over n streams
  sinkhorn_iterations: int = 20  # mHC: rounds making H_res doubly stochastic
  hc_eps: float | None = None  # a number: DeepSeek V4's mHC form (maxtext.layers.mhc) and its learned collapse (HyperHead)
  norm_eps: float = mhc.NORM_EPS  # the mHC RMSNorm's epsilon


class Residual(nnx.Module):
  """x + F(x): the ordinary residual connection (no parameters)."""

  def __call__(self, x: jax.Array, branch: Branch) -> jax.Array:
    return x + branch(x)


def make_connection(spec: ResidualSpec, dtypes: Dtypes) -> nnx.Module:
  """The connection each sub-block uses (mHC init is deterministic: it draws no random keys)."""
  if spec.streams == 1:
    return Residual()
  return mhc.HyperConnection(spec.streams, spec.emb_dim, spec.sinkhorn_iterations, weight_dtype=dtypes.params, hc_eps=spec.hc_eps, norm_eps=spec.norm_eps)


def make_head(spec: ResidualSpec, dtypes: Dtypes) -> nnx.Module | None:
  """DeepSeek V4's learned collapse of the streams before the final norm (hc_eps set, n > 1), else None (the mean)."""
  if spec.streams == 1 or spec.hc_eps is None:
    return None
  return mhc.HyperHead(spec.streams, spec.emb_dim, weight_dtype=dtypes.params, hc_eps=spec.hc_eps, norm_eps=spec.norm_eps)


def expand_streams(x: jax.Array, spec: ResidualSpec) -> jax.Array:
  """Embedding output [B, S, E] -> residual stream state before the first layer ([B, S, n, E] for n > 1)."""
  return x if spec.streams == 1 else mhc.expand(x, spec.streams)


def collapse_streams(x: jax.Array, spec: ResidualSpec) -> jax.Array:
  """Residual stream state after the last layer -> [B, S, E] for the final norm (the streams summed, / n)."""
  return x if spec.streams == 1 else mhc.collapse(x)
