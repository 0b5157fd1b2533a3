"""mHC's hand-written backward passes against jax autodiff of the reference maths (float32, tight tolerances).

The reference is the connection written plainly: RMSNorm of the flattened streams, three projections,
sigmoids, a [..., n, n] log-domain Sinkhorn loop with jax.nn.logsumexp, and the mixes as einsums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.layers import mhc

HIGHEST = jax.lax.Precision.HIGHEST
B, S, N, E = 2, 3, 4, 8


def ref_sinkhorn(logits: jax.Array, iterations: int) -> jax.Array:
  def one_round(_, lp):
    lp = lp - jax.nn.logsumexp(lp, axis=-1, keepdims=True)
    return lp - jax.nn.logsumexp(lp, axis=-2, keepdims=True)

  return jnp.exp(jax.lax.fori_loop(0, iterations, one_round, logits))


def ref_projections(x: jax.Array, norm_scale: jax.Array, w: jax.Array) -> jax.Array:
  flat = x.reshape(*x.shape[:-2], -1)
  normed = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + mhc.NORM_EPS) * norm_scale
  return jnp.einsum("...i,ij->...j", normed, w, precision=HIGHEST)


def ref_mix_in(h_pre: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.einsum("...k,...ke->...e", h_pre, x, precision=HIGHEST)


def ref_mix_out(h_res: jax.Array, h_post: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.einsum("...mk,...ke->...me", h_res, x, precision=HIGHEST) + h_post[..., None] * y[..., None, :]


def ref_connection(p: dict[str, jax.Array], x: jax.Array, branch, n: int, iterations: int) -> jax.Array:
  w = jnp.concatenate([p["pre_proj"], p["post_proj"], p["res_proj"]], axis=-1)
  proj = ref_projections(x, p["norm_scale"], w)
  pre, post, res = proj[..., :n], proj[..., n : 2 * n], proj[..., 2 * n :]
  h_pre = jax.nn.sigmoid(p["pre_scale"] * pre + p["pre_bias"])
  h_post = 2.0 * jax.nn.sigmoid(p["post_scale"] * post + p["post_bias"])
  h_res = ref_sinkhorn((p["res_scale"] * res + p["res_bias"]).reshape(*res.shape[:-1], n, n), iterations)
  return ref_mix_out(h_res, h_post, x, branch(ref_mix_in(h_pre, x)))


def _random(key: int, *shape: int, scale: float = 1.0) -> jax.Array:
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _value_and_grads(fn, args, cotangent):
  return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cotangent), argnums=tuple(range(len(args)))))(*args)


def _assert_same(ours, ref, rtol=2e-5, atol=2e-6):
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
  "ours, ref, shapes",
  [
    (mhc._mix_in, ref_mix_in, [(B, S, N), (B, S, N, E)]),
    (mhc._mix_out, ref_mix_out, [(B, S, N, N), (B, S, N), (B, S, N, E), (B, S, E)]),
    (mhc._projections, ref_projections, [(B, S, N, E), (N * E,), (N * E, N * (N + 2))]),
  ],
  ids=["mix_in", "mix_out", "projections"],
)
def test_kernel_forward_and_gradient_equal_autodiff_of_the_reference(ours, ref, shapes):
  args = [_random(i, *shape) for i, shape in enumerate(shapes)]
  cotangent = _random(99, *jax.eval_shape(ref, *args).shape)
  _assert_same(_value_and_grads(ours, args, cotangent), _value_and_grads(ref, args, cotangent))


def test_sinkhorn_forward_and_gradient_equal_autodiff_of_the_reference_loop():
  logits = _random(0, B, S, N, N, scale=3.0)
  cotangent = _random(1, B, S, N, N)
  for iterations in (1, 20):
    ours = _value_and_grads(lambda lg, it=iterations: mhc.sinkhorn_knopp(lg, it), [logits], cotangent)
    ref = _value_and_grads(lambda lg, it=iterations: ref_sinkhorn(lg, it), [logits], cotangent)
    _assert_same(ours, ref, rtol=1e-4, atol=1e-5)


def test_connection_forward_and_gradient_equal_autodiff_of_the_reference():
  """The whole connection around a branch, with every parameter perturbed from its init: the output and the
  gradients to x, to every connector parameter and to the branch weight agree."""
  conn = mhc.HyperConnection(N, E, 20, weight_dtype=jnp.float32)
  graphdef, params = nnx.split(conn)
  params = jax.tree.map(lambda v: v + 0.3 * jax.random.normal(jax.random.key(v.size), v.shape, v.dtype), params)
  x, branch_w, cotangent = _random(1, B, S, N, E), _random(2, E, E, scale=0.3), _random(3, B, S, N, E)

  def ours(params, x, branch_w):
    return nnx.merge(graphdef, params)(x, lambda h: jnp.tanh(jnp.dot(h, branch_w, precision=HIGHEST)))

  def ref(params, x, branch_w):
    p = {k: v.get_value() if hasattr(v, "get_value") else v for k, v in nnx.to_pure_dict(params).items()}
    return ref_connection(p, x, lambda h: jnp.tanh(jnp.dot(h, branch_w, precision=HIGHEST)), N, 20)

  _assert_same(_value_and_grads(ours, [params, x, branch_w], cotangent), _value_and_grads(ref, [params, x, branch_w], cotangent), rtol=1e-4, atol=1e-5)


def test_bfloat16_stream_keeps_its_dtype_through_the_backward():
  conn = mhc.HyperConnection(N, E, 3, weight_dtype=jnp.float32)
  x = _random(0, B, S, N, E).astype(jnp.bfloat16)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(conn(x, jnp.tanh).astype(jnp.float32))))(x)
  assert grad.dtype == jnp.bfloat16 and np.isfinite(np.asarray(grad, np.float32)).all()
