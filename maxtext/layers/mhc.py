"""Manifold-constrained hyper-connections (mHC, DeepSeek arXiv 2512.24880).

The residual stream is widened to n copies, state [B, S, n, E]. Around each sub-block F:

    x_hat  = RMSNorm(flatten(x))                                   [B, S, nE]
    H_pre  = sigmoid(a_pre * x_hat W_pre + b_pre)                  [B, S, n]
    H_post = 2 sigmoid(a_post * x_hat W_post + b_post)             [B, S, n]
    H_res  = SinkhornKnopp_T(a_res * x_hat W_res + b_res)          [B, S, n, n], doubly stochastic
    x'_m   = sum_k H_res[m, k] x_k + H_post[m] F(sum_k H_pre[k] x_k)

All of it is computed in float32. At init W = 0, b_pre = logit(1/n), b_post symmetric around 0
and b_res = c I, so the mean of the streams evolves exactly like the plain residual stream, and
the decoder's final collapse (sum / n) hands the plain stream to the final norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

Branch = Callable[[jax.Array], jax.Array]

GATE_INIT = 0.01  # initial a_pre, a_post, a_res: the input-dependent part starts small
POST_BIAS_SPREAD = 0.1  # b_post = linspace(-spread, spread, n): mean(H_post) = 1, streams not symmetric
RES_BIAS_DIAGONAL = 1.0  # b_res = c I
NORM_EPS = 1e-6


class MHCParam(nnx.Param):
  """A parameter of an mHC connection (marked so training and converters can tell it from base weights)."""


def sinkhorn_knopp(logits: jax.Array, iterations: int) -> jax.Array:
  """exp(logits) over the last two axes, made doubly stochastic by alternating row and column normalisation.

  Runs in the log domain in float32 (no overflow or 0/0 for any finite logits); ends with a column
  normalisation, so columns sum to 1 exactly and rows to within the convergence of `iterations` rounds.
  """
  log_p = logits.astype(jnp.float32)

  def one_round(_, lp):
    lp = lp - jax.nn.logsumexp(lp, axis=-1, keepdims=True)
    return lp - jax.nn.logsumexp(lp, axis=-2, keepdims=True)

  return jnp.exp(jax.lax.fori_loop(0, iterations, one_round, log_p))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * scale


@jax.checkpoint
def _projections(x: jax.Array, norm_scale: jax.Array, w: jax.Array) -> jax.Array:
  """RMSNorm(flatten(x)) W in float32: [..., n, E] -> [..., n (n + 2)].

  Rematerialised: the backward pass recomputes the n-times-wide float32 copy and its normalised form
  from x (which the layer keeps anyway) instead of storing two [..., nE] float32 arrays per connection.
  """
  flat = x.astype(jnp.float32).reshape(*x.shape[:-2], -1)
  return jnp.einsum("...i,ij->...j", _rms_norm(flat, norm_scale), w, precision=jax.lax.Precision.HIGHEST)


class HyperConnection(nnx.Module):
  """The mHC update around one sub-block; called as connection(x [B, S, n, E], branch) -> x'."""

  def __init__(self, n: int, emb_dim: int, sinkhorn_iterations: int, *, weight_dtype: jnp.dtype):
    if n < 2:
      raise ValueError("HyperConnection needs n >= 2 streams; n = 1 is the plain residual")
    self.n = n
    self.sinkhorn_iterations = sinkhorn_iterations
    wide = n * emb_dim

    def param(value, axes: tuple[str, ...]) -> MHCParam:
      return MHCParam(jnp.asarray(value, weight_dtype), logical_axes=axes)

    self.norm_scale = param(jnp.ones((wide,)), ("norm",))
    self.pre_proj = param(jnp.zeros((wide, n)), ("embed", "mhc"))
    self.post_proj = param(jnp.zeros((wide, n)), ("embed", "mhc"))
    self.res_proj = param(jnp.zeros((wide, n * n)), ("embed", "mhc"))
    self.pre_bias = param(jnp.full((n,), math.log(1.0 / (n - 1))), ("mhc",))  # sigmoid(logit(1/n)) = 1/n
    self.post_bias = param(jnp.linspace(-POST_BIAS_SPREAD, POST_BIAS_SPREAD, n), ("mhc",))
    self.res_bias = param(RES_BIAS_DIAGONAL * jnp.eye(n).reshape(n * n), ("mhc",))
    self.pre_scale = param(GATE_INIT, ())
    self.post_scale = param(GATE_INIT, ())
    self.res_scale = param(GATE_INIT, ())

  def mixing(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(H_pre [..., n], H_post [..., n], H_res [..., n, n]) for the stream state x [..., n, E], in float32."""
    n = self.n
    f32 = jnp.float32
    w = jnp.concatenate([self.pre_proj[...], self.post_proj[...], self.res_proj[...]], axis=-1).astype(f32)
    proj = _projections(x, self.norm_scale[...].astype(f32), w)
    pre, post, res = proj[..., :n], proj[..., n : 2 * n], proj[..., 2 * n :]
    h_pre = jax.nn.sigmoid(self.pre_scale[...].astype(f32) * pre + self.pre_bias[...].astype(f32))
    h_post = 2.0 * jax.nn.sigmoid(self.post_scale[...].astype(f32) * post + self.post_bias[...].astype(f32))
    res_logits = self.res_scale[...].astype(f32) * res + self.res_bias[...].astype(f32)
    h_res = sinkhorn_knopp(res_logits.reshape(*res.shape[:-1], n, n), self.sinkhorn_iterations)
    return h_pre, h_post, h_res

  def __call__(self, x: jax.Array, branch: Branch) -> jax.Array:
    h_pre, h_post, h_res = self.mixing(x)
    y = branch(_mix_in(h_pre, x))
    return _mix_out(h_res, h_post, x, y)


def _weighted_sum(weights: jax.Array, x: jax.Array) -> jax.Array:
  """sum_k weights[..., k] x[..., k, :] in float32: [..., n] x [..., n, E] -> [..., E].

  A broadcast product reduced over the stream axis: its gradients are elementwise (to x) and one
  [..., n, E] -> [..., n] reduction (to the weights). Slicing x into n streams instead pads each slice's
  gradient back to [..., n, E] (n full-size temporaries per connection).
  """
  return jnp.sum(weights[..., None].astype(jnp.float32) * x.astype(jnp.float32), axis=-2)


# Both mixes are rematerialised: their backward passes need only x, y and the small H matrices, so the
# float32 products are recomputed instead of stored per connection.
@jax.checkpoint
def _mix_in(h_pre: jax.Array, x: jax.Array) -> jax.Array:
  """The branch input sum_k H_pre[k] x_k, in x's dtype."""
  return _weighted_sum(h_pre, x).astype(x.dtype)


@jax.checkpoint
def _mix_out(h_res: jax.Array, h_post: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
  """x'_m = sum_k H_res[m, k] x_k + H_post[m] y, in x's dtype.

  One batched contraction over the streams, in exact float32 (HIGHEST: no low-precision matmul passes).
  Its broadcast-and-sum form is as fast forward, but its backward reduces a [..., n, n, E] product,
  which made the stream mixing cost more than the rest of the layer on XLA:CPU.
  """
  mixed = jnp.einsum("...mk,...ke->...me", h_res, x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return (mixed + h_post[..., None] * y.astype(jnp.float32)[..., None, :]).astype(x.dtype)


def expand(x: jax.Array, n: int) -> jax.Array:
  """[B, S, E] -> n identical streams [B, S, n, E]."""
  return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], n, x.shape[-1]))


def collapse(x: jax.Array) -> jax.Array:
  """[B, S, n, E] -> the streams' sum divided by n, [B, S, E].

  The final RMSNorm is invariant to that 1/n except through its epsilon; dividing explicitly makes the
  identity at init exact (summing alone leaves an error of about eps / mean(x^2) in the logits).
  """
  return jnp.mean(x.astype(jnp.float32), axis=-2).astype(x.dtype)
