"""The bounded expert-parallel receive buffer (MaxText's `ragged_buffer_factor`, maxtext.layers.expert_exchange).

Four simulated devices on one `expert` axis, each with one sequence of 4 tokens and 2 of 8 experts, top-2 routing
fixed by the test (so the load of every device is known): worst case 4 x 4 x 2 = 32 received rows, balanced 8.
- a bound that holds the actual load (but is below the worst case, so truncation runs) gives the unbounded
  dispatch's outputs and gradients bit for bit, and drops nothing;
- a small bound drops exactly the pairs MaxText's rule says (per receiving device, (source, local expert) groups in
  order, each group's earlier tokens first, until the buffer is full), counted in `dropped`, and the kept pairs give
  a plain reference's outputs and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.layers import expert_exchange, moe_dispatch
from maxtext.layers import grouped_matmul as gmm
from tests.test_train_helpers import FAST_COMPILE

EP, E, K, SEQ, D, F = 4, 8, 2, 4, 8, 6
LOCAL = E // EP


def _experts() -> np.ndarray:
  """[EP, SEQ, K]: each device's tokens' experts (two distinct per token), loading device 0's experts most."""
  rng = np.random.default_rng(3)
  return np.stack([[rng.choice(E, K, replace=False, p=np.array([3, 3, 1, 1, 1, 1, 1, 1]) / 12) for _ in range(SEQ)] for _ in range(EP)]).astype(np.int32)


def _received(experts: np.ndarray) -> np.ndarray:
  """[destination]: rows each device receives unbounded."""
  return np.bincount(experts.reshape(-1) // LOCAL, minlength=EP)


def _kept(experts: np.ndarray, limit: int) -> np.ndarray:
  """[EP, SEQ, K]: the pairs a receive buffer of `limit` rows keeps, by MaxText's rule, counted in numpy."""
  kept = np.zeros(experts.shape, bool)
  for dest in range(EP):
    room = limit
    for source in range(EP):
      for expert in range(dest * LOCAL, (dest + 1) * LOCAL):
        for t in range(SEQ):
          for j in range(K):
            if experts[source, t, j] == expert and room > 0:
              kept[source, t, j], room = True, room - 1
  return kept


def _problem():
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.normal(size=(EP, SEQ, D)), jnp.float32)
  weights = jnp.asarray(rng.uniform(0.2, 1.0, size=(EP, SEQ, K)), jnp.float32)
  w = moe_dispatch.ExpertWeights(*(jnp.asarray(rng.normal(size=s) / 3, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))))
  cotangent = jnp.asarray(rng.normal(size=(EP, SEQ, D)), jnp.float32)
  return x, weights, w, cotangent


def _plan(factor: float) -> moe_dispatch.Plan:
  return moe_dispatch.Plan(
    num_experts=E,
    k=K,
    sparse=True,
    kernel=gmm.Kernel("ragged_dot"),
    wi_tiles=gmm.Tiles(),
    wo_tiles=gmm.Tiles(),
    capacity=0,
    ragged_buffer_factor=factor,
    activations=("silu", "linear"),
    dtype=jnp.float32,
    ragged_all_to_all=False,  # XLA:CPU: the padded all_to_all emulation
  )


@pytest.fixture(scope="module")
def mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:EP]), ("expert",))


def _dispatch_fn(mesh, factors):
  """One jitted function: per factor (loss, dropped, grads of x, weights and expert weights)."""
  experts = jnp.asarray(_experts())
  valid = jnp.ones((EP, SEQ), bool)
  layout = moe_dispatch.Layout(batch=("expert",), experts=("expert",), wi=(("expert",), (), ()), wo=(("expert",), (), ()), sizes=(("expert", EP),))

  def run(x, weights, w, cotangent):
    out = []
    for factor in factors:

      def loss(x, weights, w, factor=factor):
        y, dropped = moe_dispatch.dispatch(x, weights, experts, valid, w, layout, _plan(factor), mesh)
        return jnp.sum(y * cotangent), dropped

      out.append(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, weights, w))
    return out

  return jax.jit(run, compiler_options=FAST_COMPILE)


def _reference(x, weights, w, cotangent, kept):
  def loss(x, weights, w):
    tokens = x.reshape(-1, D)
    h = jax.nn.silu(jnp.einsum("td,edf->tef", tokens, w.wi_0)) * jnp.einsum("td,edf->tef", tokens, w.wi_1)
    out = jnp.einsum("tef,efd->ted", h, w.wo)
    chosen = jnp.take_along_axis(out, jnp.asarray(_experts()).reshape(-1, K)[:, :, None], axis=1)
    y = jnp.einsum("tkd,tk->td", chosen, (weights * kept).reshape(-1, K))
    return jnp.sum(y.reshape(x.shape) * cotangent)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, weights, w)


def test_truncate_keeps_groups_in_source_then_expert_order():
  by_dest = jnp.asarray(np.arange(2 * 2 * 2).reshape(2, 2, 2) % 4 + 1)  # [source, destination, local]: [[[1,2],[3,4]],[[1,2],[3,4]]]
  kept = np.asarray(expert_exchange.truncate(by_dest, 5))
  # destination 0 receives source 0's 1 + 2, then source 1's 1 + 2 of 2; destination 1 source 0's 3 + 2 of 4, nothing of source 1
  np.testing.assert_array_equal(kept, [[[1, 2], [3, 2]], [[1, 1], [0, 0]]])


def test_bounded_receive_buffer_drops_what_the_rule_says(mesh):
  experts = _experts()
  most = int(_received(experts).max())
  small = 0.5  # 4 rows per device: every device's buffer overflows
  assert most < EP * SEQ * K and int(_received(experts).min()) > SEQ * K * small, "the routing should need truncation at both bounds"
  fits = most / (SEQ * K)  # holds the busiest device's rows exactly, below the worst case of 32
  x, weights, w, cotangent = _problem()
  (unbounded, bounded, dropping) = _dispatch_fn(mesh, (-1.0, fits, small))(x, weights, w, cotangent)

  # a bound holding the actual load: the unbounded dispatch bit for bit, nothing dropped
  assert float(bounded[0][1]) == 0.0
  for got, want in zip(jax.tree.leaves(bounded), jax.tree.leaves(unbounded), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  # a small bound: the pairs MaxText's rule drops, counted, and the kept pairs' outputs and gradients
  kept = _kept(experts, int(SEQ * K * small))
  assert 0 < int(np.sum(~kept)) < kept.size
  (loss, dropped), grads = dropping
  assert float(dropped) == float(np.sum(~kept))
  ref_loss, ref_grads = _reference(x, weights, w, cotangent, jnp.asarray(kept, jnp.float32))
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
