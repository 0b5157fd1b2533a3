"""Manifold-constrained hyper-connections: Sinkhorn, identity at init (every family, HF-loaded too), n = 1, axes, counts, training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import from_hf, models
from maxtext.config import ConfigError, from_overrides
from maxtext.counting import param_count
from maxtext.layers.mhc import HyperConnection, MHCParam, sinkhorn_knopp
from maxtext.layers.residual import Residual, collapse_streams, expand_streams
from maxtext.models import specs
from tests.hf_fixtures import FAMILY_CONFIGS, hf_logits, save_tiny_model
from tests.test_models import FAMILY_OVERRIDES, tiny


def jit_logits(model, toks) -> np.ndarray:
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, toks))


def test_sinkhorn_is_doubly_stochastic_with_finite_gradients():
  logits = jax.random.normal(jax.random.key(0), (64, 4, 4))
  p = np.asarray(sinkhorn_knopp(logits, 20))
  assert p.dtype == np.float32 and (p > 0).all()
  np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-3)
  np.testing.assert_allclose(p.sum(-2), 1.0, atol=1e-3)
  weights = jax.random.normal(jax.random.key(1), (64, 4, 4))
  grad_fn = jax.jit(jax.grad(lambda x: jnp.sum(sinkhorn_knopp(x, 20) * weights)))
  grad = np.asarray(grad_fn(logits))
  assert np.isfinite(grad).all() and np.abs(grad).max() > 1e-3
  assert np.isfinite(np.asarray(grad_fn(300.0 * logits))).all()  # extreme logits stay finite in the log domain
  assert sinkhorn_knopp(logits.astype(jnp.bfloat16), 3).dtype == jnp.float32


def test_connection_init_mixing():
  conn = HyperConnection(4, 8, 20, weight_dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(0), (2, 3, 4, 8))
  h_pre, h_post, h_res = conn.mixing(x)
  np.testing.assert_allclose(np.asarray(h_pre), 0.25, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(h_post).mean(-1), 1.0, rtol=1e-6)
  assert len(set(np.round(np.asarray(h_post)[0, 0], 6))) == 4  # streams differ (symmetry broken)
  np.testing.assert_allclose(np.asarray(h_res).sum(-2), 1.0, atol=1e-6)
  # mean of the streams evolves like the plain residual: mean(x') = mean(x) + F(mean(x))
  out = conn(x, jnp.tanh)
  mean = x.mean(-2)
  np.testing.assert_allclose(np.asarray(out.mean(-2)), np.asarray(mean + jnp.tanh(mean)), atol=1e-5)


@pytest.fixture(scope="module")
def saved_hf(tmp_path_factory):
  out = {}
  for name in FAMILY_CONFIGS:
    d = tmp_path_factory.mktemp(name.replace(".", "_"))
    out[name] = (d, save_tiny_model(name, d))
  return out


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_identity_at_init_on_hf_weights(saved_hf, name):
  hf_dir, torch_model = saved_hf[name]
  toks = np.random.default_rng(0).integers(0, 97, size=(2, 10)).astype(np.int32)
  kw = dict(dtype="float32", matmul_precision="highest")
  plain = jit_logits(from_hf(hf_dir, **kw)[0], toks)
  np.testing.assert_allclose(plain, hf_logits(torch_model, toks), atol=1e-4)
  for n in (2, 4):
    model, config = from_hf(hf_dir, mhc_expansion_rate=n, scan_layers=not (n == 4 and name == "gemma2"), **kw)
    assert config.mhc_expansion_rate == n and any(isinstance(v, MHCParam) for _, v in nnx.to_flat_state(nnx.state(model)))
    np.testing.assert_allclose(jit_logits(model, toks), plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", list(FAMILY_OVERRIDES))
def test_param_count_matches_counting(family):
  for kw in (dict(mhc_expansion_rate=2), dict(mhc_expansion_rate=4, scan_layers=False)):
    config = tiny(family, **kw)
    state = nnx.state(models.abstract_model(config))
    assert sum(np.prod(v.shape) for _, v in nnx.to_flat_state(state)) == param_count(config)


def test_n1_is_the_plain_residual_with_no_extra_parameters():
  default, explicit = tiny("llama2"), tiny("llama2", mhc_expansion_rate=1, sinkhorn_iterations=3)
  a, b = nnx.state(models.abstract_model(default)), nnx.state(models.abstract_model(explicit))
  model = models.abstract_model(explicit)
  assert isinstance(model.layers.attention_connection, Residual) and isinstance(model.layers.mlp_connection, Residual)
  assert not [v for _, v in nnx.to_flat_state(b) if isinstance(v, MHCParam)]
  shapes = lambda state: {p: (v.shape, v.dtype) for p, v in nnx.to_flat_state(state)}  # noqa: E731
  assert shapes(a) == shapes(b)
  x = jnp.ones((2, 3, 32))
  assert expand_streams(x, specs.residual(explicit)) is x and collapse_streams(x, specs.residual(explicit)) is x  # the decoder's state stays [B, S, E]
  assert Residual()(x, jnp.tanh) is not None and np.array_equal(Residual()(x, jnp.tanh), x + jnp.tanh(x))


def test_sinkhorn_iterations_is_used():
  c3, c20 = tiny("llama2", mhc_expansion_rate=3, sinkhorn_iterations=3), tiny("llama2", mhc_expansion_rate=3)
  assert models.abstract_model(c3).layers.mlp_connection.sinkhorn_iterations == 3
  assert models.abstract_model(c20).layers.mlp_connection.sinkhorn_iterations == 20


def test_mhc_params_carry_logical_axes_scanned_and_unscanned():
  for scan in (True, False):
    state = nnx.state(models.abstract_model(tiny("llama2", mhc_expansion_rate=2, scan_layers=scan)))
    mhc = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(state) if isinstance(v, MHCParam)}
    assert len(mhc) == 2 * 10 * (1 if scan else 2)
    for path, v in mhc.items():
      axes = v.get_metadata()["logical_axes"]
      assert len(axes) == len(v.shape) and ("layers" in axes) == scan, path
    key = "layers/attention_connection/res_proj" if scan else "layers/1/attention_connection/res_proj"
    assert mhc[key].shape == ((2,) if scan else ()) + (64, 4)
    assert mhc[key].get_metadata()["logical_axes"][-2:] == ("embed", "mhc")


def test_expansion_rate_zero_is_rejected():
  with pytest.raises(ConfigError):
    from_overrides(num_devices=1, mhc_expansion_rate=0)
  with pytest.raises(ConfigError):
    from_overrides(num_devices=1, sinkhorn_iterations=0)
