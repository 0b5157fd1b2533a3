"""maxtext.layers.matmul.einsum: float32 accumulation forward and backward, gradients in each operand's dtype; the bf16 rounding it uses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.layers import matmul
from maxtext.layers.dtypes import round_to_bfloat16

SPECS = [("...e,ef->...f", (2, 3, 8), (8, 5)), ("bkgsd,bktd->bkgst", (2, 2, 1, 4, 8), (2, 2, 6, 8)), ("bkgst,bktd->bkgsd", (2, 2, 1, 4, 6), (2, 2, 6, 8))]


@pytest.mark.parametrize("spec,a_shape,b_shape", SPECS)
def test_float32_einsum_and_gradients_equal_jnp(spec, a_shape, b_shape):
  rng = np.random.default_rng(0)
  a, b = jnp.asarray(rng.normal(size=a_shape), jnp.float32), jnp.asarray(rng.normal(size=b_shape), jnp.float32)
  w = jnp.asarray(rng.normal(size=jnp.einsum(spec, a, b).shape), jnp.float32)

  def loss(fn):
    return jax.value_and_grad(lambda a, b: jnp.sum(fn(a, b) * w), argnums=(0, 1))(a, b)

  (l1, g1) = loss(lambda a, b: matmul.einsum(spec, a, b, dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST))
  (l2, g2) = loss(lambda a, b: jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST))
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  for x, y in zip(g1, g2):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_bf16_matmuls_accumulate_in_float32_and_float32_weights_get_float32_gradients():
  x = jnp.full((3, 16), 1.0 + 2.0**-7, jnp.bfloat16)  # 1.0078125, exact in bf16
  kernel = jnp.full((16, 8), 1.0 + 2.0**-7 + 2.0**-12, jnp.float32)  # rounds to 1.0078125 in bf16

  def loss(x, kernel):
    return jnp.sum(matmul.einsum("te,ef->tf", x, kernel, dtype=jnp.bfloat16).astype(jnp.float32))

  dx, dk = jax.grad(loss, argnums=(0, 1))(x, kernel)
  assert dx.dtype == jnp.bfloat16 and dk.dtype == jnp.float32
  # 3 x 1.0078125 = 3.0234375 needs 9 significant bits: float32 keeps it, a bf16 gradient could not.
  np.testing.assert_array_equal(np.asarray(dk), np.full((16, 8), 3 * 1.0078125, np.float32))
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.full((3, 16), 8 * 1.0078125, np.float32))


def test_backward_matmuls_take_compute_dtype_operands_and_accumulate_in_float32():
  """No float32 x bf16 promotion: every dot in forward and backward multiplies bf16 operands into float32."""
  x, kernel = jnp.ones((4, 16), jnp.bfloat16), jnp.ones((16, 8), jnp.float32)
  hlo = jax.jit(jax.value_and_grad(lambda x, k: jnp.sum(matmul.einsum("te,ef->tf", x, k, dtype=jnp.bfloat16).astype(jnp.float32)), argnums=(0, 1))).lower(
    x, kernel
  )
  dots = [line for line in hlo.as_text().splitlines() if "stablehlo.dot_general" in line]
  assert len(dots) == 3, dots
  for line in dots:
    operand_types = line.split(":")[-1]
    assert operand_types.count("bf16") == 2 and "-> tensor<" in operand_types and operand_types.rstrip().endswith("f32>"), line


def test_integer_bf16_rounding_is_bit_identical_to_astype_and_differentiates_like_it():
  rng = np.random.default_rng(0)
  finite = rng.normal(size=20000) * 10.0 ** rng.integers(-44, 38, size=20000)
  special = [np.inf, -np.inf, 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, 1e-40, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20]
  x = jnp.asarray(np.concatenate([finite, special]).astype(np.float32))
  ours = np.asarray(jax.jit(round_to_bfloat16)(x)).view(np.uint16)
  theirs = np.asarray(jax.jit(lambda x: x.astype(jnp.bfloat16))(x)).view(np.uint16)
  np.testing.assert_array_equal(ours, theirs)
  assert np.isnan(np.asarray(round_to_bfloat16(jnp.asarray([np.nan], jnp.float32)), np.float32)).all()

  def loss(cast):
    return jax.grad(lambda v: jnp.sum(jnp.sin(cast(v * 3.0).astype(jnp.float32))))(x[:100])

  np.testing.assert_array_equal(loss(round_to_bfloat16), loss(lambda v: v.astype(jnp.bfloat16)))
