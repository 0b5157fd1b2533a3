"""optimizers.keep_unused_adapter_slots: an adapter slot without gradient keeps its parameters and optimizer state.

The train-step version (several slots, weight decay, momentum from an earlier step) is in tests/test_lora_multi.py.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from maxtext.train import optimizers

TWO_SLOTS = {"enable_lora": True, "lora_rank": 2, "lora_alpha": 4.0, "max_lora_adapters": 2, "lora_adapters": ["a", "b"]}


def _flat(tree) -> dict[str, np.ndarray]:
  return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tree)}


def _moments(opt_state) -> dict[str, np.ndarray]:
  """Every array of the optimizer state, by its path (Adam's mu and nu, count, ...)."""
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(opt_state)}


@pytest.mark.parametrize("inner", [optax.adamw(1.0, weight_decay=0.1), optax.sgd(1.0, momentum=0.9)], ids=["adamw", "sgd_momentum"])
def test_wrapper_keeps_slots_without_gradient_and_passes_everything_else_through(inner):
  """On a hand-made tree (slot axis 0): a slot whose A and B gradients are all zero gets a zero update and keeps
  its state entries; the other slot and non-adapter leaves get exactly the inner optimizer's results."""
  rng = np.random.default_rng(0)
  params = {
    "mlp": {"lora": {"lora_a": rng.normal(size=(2, 3, 2)).astype(np.float32), "lora_b": rng.normal(size=(2, 2, 4)).astype(np.float32)}},
    "norm": {"scale": np.ones(4, np.float32)},
  }
  wrapped = optimizers.keep_unused_adapter_slots(inner, 0)
  state_w, state_i = wrapped.init(params), inner.init(params)
  for step in range(2):
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    if step == 1:  # slot 1 unused in the second step
      grads["mlp"]["lora"] = {k: v.copy() for k, v in grads["mlp"]["lora"].items()}
      for v in grads["mlp"]["lora"].values():
        v[1] = 0.0
    old_w = state_w
    u_w, state_w = wrapped.update(grads, state_w, params)
    u_i, state_i = inner.update(grads, state_i, params)
    for name in ("lora_a", "lora_b"):
      np.testing.assert_array_equal(u_w["mlp"]["lora"][name][0], u_i["mlp"]["lora"][name][0])
      if step == 1:
        assert np.all(np.asarray(u_w["mlp"]["lora"][name][1]) == 0) and np.any(np.asarray(u_i["mlp"]["lora"][name][1]) != 0)
    np.testing.assert_array_equal(u_w["norm"]["scale"], u_i["norm"]["scale"])
  new_leaves, old_leaves = jax.tree_util.tree_leaves_with_path(state_w), jax.tree.leaves(old_w)
  kept = [np.array_equal(np.asarray(n)[1], np.asarray(o)[1]) for (path, n), o in zip(new_leaves, old_leaves) if "lora" in jax.tree_util.keystr(path)]
  assert kept and all(kept)


@pytest.mark.parametrize("opt_type", ["muon", "adamw"])
def test_a_slots_update_does_not_depend_on_another_slots_gradient(opt_type):
  """Muon orthogonalises each slot's A and B on their own (the slot axis is a batch axis), so changing slot 1's
  gradient leaves slot 0's update bit-identical; AdamW is elementwise anyway."""
  from maxtext import models
  from maxtext.layers.lora import LoRAParam
  from tests.test_models import tiny

  config = tiny("llama2", opt_type=opt_type, gradient_clipping_threshold=0.0, lora={**TWO_SLOTS, "max_lora_rank": 2})  # no global-norm coupling
  _, adapters, _ = nnx.split(models.abstract_model(config), LoRAParam, ...)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda v: rng.normal(size=v.shape).astype(np.float32), adapters)
  grads = jax.tree.map(lambda v: rng.normal(size=v.shape).astype(np.float32), adapters)
  other = jax.tree.map(lambda g: np.concatenate([g[:, :1], 3.0 * g[:, 1:]], axis=1) if config.scan_layers else None, grads)
  opt = optimizers.build(config)
  update = jax.jit(lambda g: opt.update(g, opt.init(params), params)[0])
  first, second = _flat(update(grads)), _flat(update(other))
  assert first
  for key in first:
    np.testing.assert_array_equal(first[key][:, 0], second[key][:, 0], err_msg=key)
    assert not np.array_equal(first[key][:, 1], second[key][:, 1]), key
