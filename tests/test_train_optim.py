"""Schedules and optimizers at chosen steps, weight-decay mask, clipping, Muon axes, spike detection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.train import optimizers
from maxtext.train.schedules import learning_rate_schedule
from maxtext.train.step import _spike_check
from tests.test_train_helpers import tiny_config


@pytest.mark.parametrize(
  "overrides, expected",
  [
    (dict(lr_schedule_type="cosine"), {0: 0.0, 5: 0.5, 10: 1.0, 55: 0.55, 100: 0.0, 150: 0.0}),
    (dict(lr_schedule_type="wsd", wsd_decay_style="linear"), {5: 0.5, 10: 1.0, 79: 1.0, 80: 1.0, 90: 0.55, 100: 0.0}),
    (dict(lr_schedule_type="wsd", wsd_decay_style="cosine"), {10: 1.0, 85: 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi / 4)), 90: 0.55}),
    (dict(lr_schedule_type="cosine", learning_rate_schedule_steps=50, steps=100), {0: 1.0, 25: 0.55, 50: 0.0, 70: 0.0}),
  ],
)
def test_schedule_values(overrides, expected):
  kw = dict(steps=100, learning_rate=1.0, warmup_steps_fraction=0.1, learning_rate_final_fraction=0.1, wsd_decay_steps_fraction=0.2)
  if overrides.get("learning_rate_schedule_steps") == 50:
    kw["warmup_steps_fraction"] = 0.0
  schedule = learning_rate_schedule(tiny_config(num_devices=1, **{**kw, **overrides}))
  for step, lr in expected.items():
    np.testing.assert_allclose(float(schedule(step)), lr, rtol=1e-5, atol=1e-7, err_msg=f"step {step}")


class Params(nnx.Module):
  def __init__(self):
    self.kernel = nnx.Param(jnp.full((2, 3), 2.0), logical_axes=("embed", "mlp"))
    self.scale = nnx.Param(jnp.full((3,), 2.0), logical_axes=("norm",))
    self.bias = nnx.Param(jnp.full((3,), 2.0), logical_axes=("mlp",))


def _params():
  return nnx.state(Params(), nnx.Param)


def _update(config, grads_value=1.0, steps=1):
  opt = optimizers.build(config)
  params = _params()
  grads = jax.tree.map(lambda p: jnp.full_like(p, grads_value), params)
  state = opt.init(params)
  for _ in range(steps):
    updates, state = opt.update(grads, state, params)
  return {k: np.asarray(v) for k, v in nnx.to_pure_dict(updates).items()}


def test_adamw_first_step_decays_kernels_but_not_norm_scales_or_biases():
  config = tiny_config(num_devices=1, opt_type="adamw", adam_weight_decay=0.1, gradient_clipping_threshold=0.0)
  u = _update(config)
  np.testing.assert_allclose(u["kernel"], -(1.0 + 0.1 * 2.0), rtol=1e-6)  # -(m/sqrt(v) + wd * p) at unit lr
  np.testing.assert_allclose(u["scale"], -1.0, rtol=1e-6)
  np.testing.assert_allclose(u["bias"], -1.0, rtol=1e-6)


def test_adamw_mask_exempts_the_parameters_its_patterns_find_from_decay():
  """adamw_mask (MaxText's key): regular expressions over parameter paths; what they find gets no weight decay,
  with AdamW and with Muon's masked decay alike; other kernels still decay. A bad pattern is a one-line error."""
  from maxtext.errors import ConfigError

  for opt_type in ("adamw", "muon"):
    config = tiny_config(num_devices=1, opt_type=opt_type, adam_weight_decay=0.1, gradient_clipping_threshold=0.0, adamw_mask=["^kern"])
    plain = _update(config.model_copy(update={"adamw_mask": []}))
    masked = _update(config)
    np.testing.assert_allclose(masked["kernel"], plain["kernel"] + 0.1 * 2.0, rtol=1e-5)  # the decay term -wd * p is gone
    np.testing.assert_allclose(masked["scale"], plain["scale"], rtol=1e-6)
  with pytest.raises(ConfigError, match="adamw_mask"):
    tiny_config(num_devices=1, adamw_mask=["(unclosed"])


def test_sgd_momentum_accumulates():
  config = tiny_config(num_devices=1, opt_type="sgd", sgd_momentum=0.5, gradient_clipping_threshold=0.0)
  np.testing.assert_allclose(_update(config, steps=2)["kernel"], -(1.0 + 0.5), rtol=1e-6)


def test_gradient_clipping_bounds_the_update_norm():
  config = tiny_config(num_devices=1, opt_type="sgd", sgd_momentum=0.0, gradient_clipping_threshold=0.5)
  u = _update(config, grads_value=10.0)
  norm = np.sqrt(sum(np.sum(v**2) for v in u.values()))
  np.testing.assert_allclose(norm, 0.5, rtol=1e-5)


def test_muon_orthogonalises_kernels_and_uses_adam_for_vectors():
  config = tiny_config(num_devices=1, opt_type="muon", muon_beta=0.9, adam_weight_decay=0.0, gradient_clipping_threshold=0.0)
  opt = optimizers.build(config)
  params = _params()
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  updates, _ = opt.update(grads, opt.init(params), params)
  u = nnx.to_pure_dict(updates)
  s = np.linalg.svd(np.asarray(u["kernel"]), compute_uv=False)
  assert s.max() / s.min() < 1.5  # Newton-Schulz pushes singular values towards each other
  scale = np.abs(np.asarray(u["scale"]))
  np.testing.assert_allclose(scale, scale[0], rtol=1e-4)  # first (N)Adam step: the same magnitude whatever the gradient


def test_muon_dimension_numbers_follow_logical_axes():
  dims = optimizers.muon_dimension_numbers
  assert dims(("layers", "embed", "heads", "head_dim")) == optimizers.MuonDimensionNumbers((1,), (2, 3))
  assert dims(("layers", "heads", "head_dim", "embed")) == optimizers.MuonDimensionNumbers((1, 2), (3,))
  assert dims(("layers", "exp", "mlp", "embed")) == optimizers.MuonDimensionNumbers((2,), (3,))
  assert dims(("vocab", "embed")) is None and dims(("layers", "norm")) is None and dims(None) is None


def test_spike_detection_skips_outliers_and_non_finite_losses():
  config = tiny_config(num_devices=1, skip_step_on_spikes=True, skip_step_interval=4, skip_step_scaling_factor=3.0)
  spike = {"losses": jnp.zeros((4,), jnp.float32), "count": jnp.zeros((), jnp.int32)}
  for loss in (2.0, 2.1, 1.9, 2.0):
    skip, spike = _spike_check(spike, jnp.float32(loss), config)
    assert not bool(skip)  # window not full yet
  assert int(spike["count"]) == 4
  skip, after = _spike_check(spike, jnp.float32(5.0), config)
  assert bool(skip) and int(after["count"]) == 4 and np.array_equal(after["losses"], spike["losses"])
  skip, _ = _spike_check(spike, jnp.float32(2.05), config)
  assert not bool(skip)
  skip, _ = _spike_check(spike, jnp.float32(np.nan), config)
  assert bool(skip)


def _moment_dtypes(config) -> dict[str, set[str]]:
  """The optimizer state's moment fields ('mu', 'nu', 'trace') -> the dtypes of their leaves."""
  found: dict[str, set[str]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(optimizers.build(config).init(_params()))[0]:
    names = [getattr(k, "name", None) for k in path]
    for field in {"mu", "nu", "trace"}.intersection(names):
      found.setdefault(field, set()).add(jnp.dtype(leaf.dtype).name)
  return found


@pytest.mark.parametrize("opt_type", ["adamw", "muon", "sgd"])
def test_mu_dtype_sets_the_first_moment_dtype_and_defaults_to_weight_dtype(opt_type):
  first = "trace" if opt_type == "sgd" else "mu"
  kw = dict(num_devices=1, opt_type=opt_type, sgd_momentum=0.9)
  assert _moment_dtypes(tiny_config(**kw))[first] == {"float32"}
  assert _moment_dtypes(tiny_config(**kw, weight_dtype="bfloat16"))[first] == {"bfloat16"}  # MaxText: '' inherits weight_dtype
  got = _moment_dtypes(tiny_config(**kw, mu_dtype="bfloat16"))
  assert got[first] == {"bfloat16"} and got.get("nu", {"float32"}) == {"float32"}  # the second moment keeps its float32
