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

DeepSeek V4's checkpoints (attn_hc, ffn_hc: fn, base, scale) use the same projections, H_post and
stream mixes, and differ in three places (`HyperConnection(hc_eps=...)` computes their form):
  - H_pre = sigmoid(...) + hc_eps;
  - H_res: V4 mixes x'_m = sum_k C[k, m] x_k, so H_res = C^T, and C = softmax over C's rows + hc_eps,
    then a column division, then hc_sinkhorn_iters - 1 rounds of row and column divisions, each
    dividing by (sum + hc_eps). In H_res's orientation that is columns first (ours: rows first, in the
    log domain, no eps): after finitely many rounds the two are different matrices;
  - the RMSNorm has no scale (norm_scale = 1) and its epsilon is the model's rms_norm_eps.
And the decoder's final collapse is learned (`HyperHead`, V4's hc_head), not the mean of the streams.
"""

from __future__ import annotations

import functools
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


def _normalise(lp: jax.Array, axis: int) -> jax.Array:
  """lp - logsumexp(lp, axis): one Sinkhorn half-step in the log domain (shifted by the maximum, so it never overflows)."""
  peak = jnp.max(lp, axis=axis, keepdims=True)
  return lp - (peak + jnp.log(jnp.sum(jnp.exp(lp - peak), axis=axis, keepdims=True)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _sinkhorn_log(log_p: jax.Array, iterations: int) -> jax.Array:
  """`iterations` rounds of row (axis 1) then column (axis 0) normalisation of log_p [n, n, ...]."""
  return _sinkhorn_log_fwd(log_p, iterations)[0]


def _sinkhorn_log_fwd(log_p, iterations):
  def one_round(lp, _):
    rows = _normalise(lp, 1)
    cols = _normalise(rows, 0)
    return cols, (rows, cols)

  final, iterates = jax.lax.scan(one_round, log_p, length=iterations)
  return final, iterates


def _sinkhorn_log_bwd(iterations, iterates, d):
  """Each half-step y = lp - logsumexp(lp) has the gradient d lp = d y - exp(y) sum(d y): two ops per half-step, on
  the stored iterates (autodiff of the loop recomputes the softmax and adds several ops per half-step)."""
  del iterations

  def back(d, round_iterates):
    rows, cols = round_iterates
    d = d - jnp.exp(cols) * jnp.sum(d, axis=0, keepdims=True)
    return d - jnp.exp(rows) * jnp.sum(d, axis=1, keepdims=True), None

  d, _ = jax.lax.scan(back, d, iterates, reverse=True)
  return (d,)


_sinkhorn_log.defvjp(_sinkhorn_log_fwd, _sinkhorn_log_bwd)


def sinkhorn_knopp(logits: jax.Array, iterations: int) -> jax.Array:
  """exp(logits) over the last two axes, made doubly stochastic by alternating row and column normalisation.

  Runs in the log domain in float32 (no overflow or 0/0 for any finite logits); ends with a column
  normalisation, so columns sum to 1 exactly and rows to within the convergence of `iterations` rounds.
  The rounds run on [n, n, ...] (the tokens minor), so each normalisation is an elementwise pass over
  vectors of tokens rather than many reductions of length n, and the backward pass is written by hand
  (`_sinkhorn_log_bwd`): together a fraction of the ops of autodiff through a [..., n, n] loop on XLA:CPU.
  """
  log_p = jnp.moveaxis(logits.astype(jnp.float32), (-2, -1), (0, 1))
  return jnp.moveaxis(jnp.exp(_sinkhorn_log(log_p, iterations)), (0, 1), (-2, -1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _projections(x: jax.Array, norm_scale: jax.Array, w: jax.Array, eps: float = NORM_EPS) -> jax.Array:
  """RMSNorm(flatten(x)) W in float32: [..., n, E] -> [..., n (n + 2)], as one matmul.

  The norm's scale is folded into W and its per-token 1/rms applied to the n (n + 2) outputs, so the
  normalised [..., nE] stream is never formed (forward or backward): (x r s) W = r (x (s W)).
  The backward pass keeps x itself (which the stream mixes keep too), not a flattened float32 copy,
  so the layer stores the stream once.
  """
  return _projections_fwd(x, norm_scale, w, eps)[0]


def _flat(x: jax.Array) -> jax.Array:
  return x.astype(jnp.float32).reshape(*x.shape[:-2], -1)


def _projections_fwd(x, norm_scale, w, eps):
  flat = _flat(x)
  inv_rms = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
  raw = jnp.einsum("...i,ij->...j", flat, norm_scale[:, None] * w, precision=jax.lax.Precision.HIGHEST)
  return inv_rms * raw, (x, norm_scale, w, inv_rms, raw)


def _projections_bwd(eps, residuals, d_proj):
  """With raw = x (s W) and proj = r raw, r = (mean(x^2) + eps)^-1/2: d raw = r d_proj, dr = <d_proj, raw>,
  dx = d raw (s W)^T - r^3 dr x / nE, d(s W) = x^T d raw (summed over tokens), dW = s d(s W), ds = rowsum(d(s W) W)."""
  del eps  # inside inv_rms
  x, norm_scale, w, inv_rms, raw = residuals
  highest = jax.lax.Precision.HIGHEST
  flat = _flat(x)
  d_raw = inv_rms * d_proj
  d_inv = jnp.sum(d_proj * raw, axis=-1, keepdims=True)
  d_flat = jnp.einsum("...j,ij->...i", d_raw, norm_scale[:, None] * w, precision=highest) - (d_inv * inv_rms**3 / flat.shape[-1]) * flat
  d_scaled_w = jnp.einsum("ti,tj->ij", flat.reshape(-1, flat.shape[-1]), d_raw.reshape(-1, d_raw.shape[-1]), precision=highest)
  return d_flat.reshape(x.shape).astype(x.dtype), jnp.sum(d_scaled_w * w, axis=-1), norm_scale[:, None] * d_scaled_w


_projections.defvjp(_projections_fwd, _projections_bwd)


class HyperConnection(nnx.Module):
  """The mHC update around one sub-block; called as connection(x [B, S, n, E], branch) -> x'."""

  def __init__(self, n: int, emb_dim: int, sinkhorn_iterations: int, *, weight_dtype: jnp.dtype, hc_eps: float | None = None, norm_eps: float = NORM_EPS):
    """hc_eps: None for this project's form; a number for DeepSeek V4's (module docstring). norm_eps: the RMSNorm's."""
    if n < 2:
      raise ValueError("HyperConnection needs n >= 2 streams; n = 1 is the plain residual")
    self.n = n
    self.sinkhorn_iterations = sinkhorn_iterations
    self.hc_eps = hc_eps
    self.norm_eps = norm_eps
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
    proj = _projections(x, self.norm_scale[...].astype(f32), w, self.norm_eps)
    pre, post, res = proj[..., :n], proj[..., n : 2 * n], proj[..., 2 * n :]
    h_pre = jax.nn.sigmoid(self.pre_scale[...].astype(f32) * pre + self.pre_bias[...].astype(f32))
    h_post = 2.0 * jax.nn.sigmoid(self.post_scale[...].astype(f32) * post + self.post_bias[...].astype(f32))
    res_logits = (self.res_scale[...].astype(f32) * res + self.res_bias[...].astype(f32)).reshape(*res.shape[:-1], n, n)
    if self.hc_eps is None:
      return h_pre, h_post, sinkhorn_knopp(res_logits, self.sinkhorn_iterations)
    return h_pre + self.hc_eps, h_post, sinkhorn_deepseek_v4(res_logits, self.sinkhorn_iterations, self.hc_eps)

  def __call__(self, x: jax.Array, branch: Branch) -> jax.Array:
    h_pre, h_post, h_res = self.mixing(x)
    y = branch(_mix_in(h_pre, x))
    return _mix_out(h_res, h_post, x, y)


def sinkhorn_deepseek_v4(logits: jax.Array, iterations: int, eps: float) -> jax.Array:
  """DeepSeek V4's H_res from logits [..., m, k] in H_res's orientation (V4's C = H_res^T): with L = logits^T,
  C = softmax(L, rows) + eps, C /= (column sums + eps), then iterations - 1 rounds of the row then the column
  division, each by (sum + eps); returns C^T. In float32, differentiated by autodiff."""
  c = jax.nn.softmax(jnp.swapaxes(logits.astype(jnp.float32), -1, -2), axis=-1) + eps
  c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
  for _ in range(iterations - 1):
    c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
  return jnp.swapaxes(c, -1, -2)


class HyperHead(nnx.Module):
  """DeepSeek V4's final collapse (hc_head): sum_k (sigmoid(a x_hat w_k + b_k) + eps) x_k, x_hat = the streams
  flattened and RMS-normalised without a scale; [B, S, n, E] -> [B, S, E]. (This project's collapse is the mean.)"""

  def __init__(self, n: int, emb_dim: int, *, weight_dtype: jnp.dtype, hc_eps: float, norm_eps: float):
    self.hc_eps = hc_eps
    self.norm_eps = norm_eps
    self.proj = MHCParam(jnp.zeros((n * emb_dim, n), weight_dtype), logical_axes=("embed", "mhc"))
    self.bias = MHCParam(jnp.full((n,), math.log(1.0 / (n - 1)), weight_dtype), logical_axes=("mhc",))  # 1/n each
    self.scale = MHCParam(jnp.asarray(GATE_INIT, weight_dtype), logical_axes=())

  def __call__(self, x: jax.Array) -> jax.Array:
    f32 = jnp.float32
    ones = jnp.ones((x.shape[-2] * x.shape[-1],), f32)
    proj = _projections(x, ones, self.proj[...].astype(f32), self.norm_eps)
    weights = jax.nn.sigmoid(self.scale[...].astype(f32) * proj + self.bias[...].astype(f32)) + self.hc_eps
    return _mix_in(weights, x)


# The stream mixes have hand-written backward passes. Their autodiff forms turn the per-token n x n
# products into batched matmuls of tiny matrices (or materialised [..., n, n, E] broadcasts), which
# XLA:CPU runs far below its elementwise speed. Here every [..., n, E] product is a sum of n
# per-stream terms (elementwise, one fused pass); the gradients of H_pre and H_post are batched
# matrix-vector products over E and that of H_res one batched [n, E] x [E, n] product (in the train
# step faster than n matrix-vector products on stream slices, which XLA copies out first; figure:
# benchmarks/README.md, figures behind code comments).
# The residuals are x, y and the small H matrices, which the layer keeps anyway: nothing n-times-wide
# is stored per connection.
def _streams(x: jax.Array) -> list[jax.Array]:
  """x [..., n, E] -> its n streams [..., E], in float32."""
  return [x[..., k, :].astype(jnp.float32) for k in range(x.shape[-2])]


def _stream_dots(x: jax.Array, v: jax.Array) -> jax.Array:
  """<x_k, v> for each stream k: [..., n, E] x [..., E] -> [..., n], in float32.

  A batched matrix-vector product: on XLA:CPU much faster than reducing the broadcast product (figure:
  benchmarks/README.md, figures behind code comments).
  """
  return jnp.einsum("...ke,...e->...k", x.astype(jnp.float32), v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


@jax.custom_vjp
def _mix_in(h_pre: jax.Array, x: jax.Array) -> jax.Array:
  """The branch input sum_k H_pre[k] x_k ([..., n] x [..., n, E] -> [..., E]), in x's dtype."""
  return sum(h_pre[..., k, None] * x_k for k, x_k in enumerate(_streams(x))).astype(x.dtype)


def _mix_in_fwd(h_pre, x):
  return _mix_in(h_pre, x), (h_pre, x)


def _mix_in_bwd(residuals, du):
  h_pre, x = residuals
  du = du.astype(jnp.float32)
  dx = (h_pre[..., None] * du[..., None, :]).astype(x.dtype)
  dh_pre = _stream_dots(x, du)
  return dh_pre, dx


_mix_in.defvjp(_mix_in_fwd, _mix_in_bwd)


@jax.custom_vjp
def _mix_out(h_res: jax.Array, h_post: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
  """x'_m = sum_k H_res[m, k] x_k + H_post[m] y ([..., n, E] from x [..., n, E] and y [..., E]), in x's dtype."""
  y = y.astype(jnp.float32)[..., None, :]
  mixed = sum(h_res[..., :, k, None] * x_k[..., None, :] for k, x_k in enumerate(_streams(x)))
  return (mixed + h_post[..., None] * y).astype(x.dtype)


def _mix_out_fwd(h_res, h_post, x, y):
  return _mix_out(h_res, h_post, x, y), (h_res, h_post, x, y)


def _mix_out_bwd(residuals, g):
  """dx_k = sum_m H_res[m, k] g_m, dy = sum_m H_post[m] g_m, dH_res[m, k] = <g_m, x_k>, dH_post[m] = <g_m, y>."""
  h_res, h_post, x, y = residuals
  g_streams = _streams(g)
  dx = sum(h_res[..., m, :, None] * g_m[..., None, :] for m, g_m in enumerate(g_streams))
  dy = sum(h_post[..., m, None] * g_m for m, g_m in enumerate(g_streams))
  dh_res = jnp.einsum("...me,...ke->...mk", g.astype(jnp.float32), x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  dh_post = _stream_dots(g, y)
  return dh_res, dh_post, dx.astype(x.dtype), dy.astype(y.dtype)


_mix_out.defvjp(_mix_out_fwd, _mix_out_bwd)


def expand(x: jax.Array, n: int) -> jax.Array:
  """[B, S, E] -> n identical streams [B, S, n, E]."""
  return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], n, x.shape[-1]))


def collapse(x: jax.Array) -> jax.Array:
  """[B, S, n, E] -> the streams' sum divided by n, [B, S, E].

  The final RMSNorm is invariant to that 1/n except through its epsilon; dividing explicitly makes the
  identity at init exact (summing alone leaves an error of about eps / mean(x^2) in the logits).
  """
  return jnp.mean(x.astype(jnp.float32), axis=-2).astype(x.dtype)
