"""Several LoRA adapters in one model: slots, per-row adapter ids, ranks up to max_lora_rank, one adapter
equal to the single-adapter path bit for bit, and no gradient leaking between adapters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import models
from maxtext.config import ConfigError
from maxtext.config.adapters import adapter_specs, single_adapter_config
from maxtext.convert import peft
from maxtext.convert.checkpoint_io import put_slot, slot_params
from maxtext.counting import param_count
from maxtext.layers.lora import LoRAParam
from maxtext.train import setup as setup_lib
from tests.test_models import tiny, tokens

SINGLE = {"enable_lora": True, "lora_rank": 2, "lora_alpha": 4.0}
MULTI = {**SINGLE, "max_lora_adapters": 3, "max_lora_rank": 2, "lora_adapters": ["alice", "bob:1", "carol:2"]}


def _flat(state) -> dict[str, jax.Array]:
  return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def _with_random_b(model: nnx.Module, seed: int) -> nnx.Module:
  """Nonzero B everywhere (B starts at zero), so the adapters change the output."""
  graphdef, params, rest = nnx.split(model, LoRAParam, ...)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  params = jax.tree.unflatten(tree, [leaf + 0.1 * jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)])
  return nnx.merge(graphdef, params, rest)


_COMPILED: dict[str, object] = {}


def _grad_fn(name: str, graphdef: nnx.GraphDef):
  """One compiled (loss, adapter gradients) function per model, shared by the tests."""
  if name in _COMPILED:
    return _COMPILED[name]

  @jax.jit
  def run(adapters, rest, toks, ids):
    def loss(adapters):
      logits = nnx.merge(graphdef, adapters, rest)(toks, adapter_ids=ids)
      return jnp.sum(jax.nn.log_softmax(logits)[..., 1])

    return jax.value_and_grad(loss)(adapters)

  _COMPILED[name] = run
  return run


def _loss_and_adapter_grads(name: str, model: nnx.Module, toks: jax.Array, ids: jax.Array | None):
  graphdef, adapters, rest = nnx.split(model, LoRAParam, ...)
  value, grads = _grad_fn(name, graphdef)(adapters, rest, toks, ids)
  return value, _flat(grads)


@pytest.fixture(scope="module")
def multi_model():
  return _with_random_b(models.build(tiny("llama2", lora=MULTI)), seed=1)


def test_adapter_specs_and_one_line_errors():
  assert [(s.name, s.rank) for s in adapter_specs(tiny("llama2", lora=MULTI))] == [("alice", 2), ("bob", 1), ("carol", 2)]
  assert [s.name for s in adapter_specs(tiny("llama2", lora={**SINGLE, "max_lora_adapters": 2}))] == ["adapter_0", "adapter_1"]
  bad = [
    {"lora_adapters": ["a", "b"]},  # 3 slots, 2 names
    {"lora_adapters": ["a", "a", "b"]},
    {"lora_adapters": ["a", "b:3", "c"]},  # rank above max_lora_rank
    {"lora_adapters": ["a", "b:x", "c"]},
    {"max_lora_adapters": 1, "lora_adapters": ["a"]},
  ]
  for override in bad:
    with pytest.raises(ConfigError) as err:
      tiny("llama2", lora={**MULTI, **override})
    assert "\n" not in str(err.value)


def test_slots_shapes_and_counting():
  for scan in (True, False):
    config = tiny("llama2", scan_layers=scan, lora=MULTI)
    state = nnx.state(models.abstract_model(config))
    flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
    prefix, lead = ("layers", (2,)) if scan else ("layers/0", ())
    assert flat[f"{prefix}/attention/query/lora/lora_a"].shape == lead + (3, 32, 2)
    assert flat[f"{prefix}/attention/query/lora/lora_b"].shape == lead + (3, 2, 4, 8)
    assert sum(np.prod(v.shape) for v in flat.values()) == param_count(config)


def test_one_adapter_equals_the_single_adapter_path_bit_for_bit(multi_model):
  """Slot 0 holding the single model's adapters: the same loss bit for bit, the same adapter gradients.

  (Gradients agree to float32 rounding: XLA may order the backward contraction into the stacked slots
  differently from the one into a single adapter.)
  """
  single = _with_random_b(models.build(tiny("llama2", lora=SINGLE)), seed=2)
  s_flat = _flat(nnx.state(single, nnx.Param))
  m_graph, m_params, m_rest = nnx.split(multi_model, nnx.Param, ...)
  m_flat = _flat(m_params)
  for key, value in m_flat.items():  # base from the single model; slot 0 = its adapters; other slots random
    if key.endswith(("lora_a", "lora_b")):
      assert value.shape[0] == 2 and value.shape[1] == 3  # [layers, slots, ...]
      m_flat[key] = value.at[:, 0].set(s_flat[key])
    else:
      assert np.array_equal(value, s_flat[key])  # adapters draw their keys without shifting the base's
  paths = {"/".join(map(str, p)): p for p, _ in nnx.to_flat_state(m_params)}
  m_params = nnx.from_flat_state({paths[k]: v for k, v in m_flat.items()})
  model = nnx.merge(m_graph, m_params, m_rest)
  toks = tokens(batch=3)
  s_loss, s_grads = _loss_and_adapter_grads("single", single, toks, None)
  for ids in (jnp.zeros((3,), jnp.int32),):  # every row on slot 0
    m_loss, m_grads = _loss_and_adapter_grads("multi", model, toks, ids)
    assert np.array_equal(s_loss, m_loss)
    for key, grad in s_grads.items():
      np.testing.assert_allclose(m_grads[key][:, 0], grad, rtol=1e-5, atol=1e-6, err_msg=key)
      assert not np.any(m_grads[key][:, 1:]), key  # no row uses the other slots


def test_gradients_never_leak_between_adapters(multi_model):
  ids = jnp.asarray([0, 1, 2, 1], jnp.int32)
  toks = tokens(batch=4, seed=3)
  _, grads = _loss_and_adapter_grads("multi", multi_model, toks, ids)
  # Rows of other adapters change completely: slot 0's gradients stay the same, bit for bit.
  others = jnp.where((ids == 0)[:, None], toks, tokens(batch=4, seed=4))
  _, moved = _loss_and_adapter_grads("multi", multi_model, others, ids)
  for key in grads:
    assert np.array_equal(grads[key][:, 0], moved[key][:, 0]), key
    assert np.any(grads[key][:, 1]) and np.any(grads[key][:, 2]), key  # one step trains every adapter in the batch
  # bob has rank 1 of max 2: his masked rank column gets no gradient; rows with id -1 use no adapter.
  assert not np.any(grads["layers/attention/query/lora/lora_a"][:, 1, ..., 1])
  assert not np.any(grads["layers/attention/query/lora/lora_b"][:, 1, 1])
  _, none = _loss_and_adapter_grads("multi", multi_model, toks, jnp.full((4,), -1, jnp.int32))
  assert not any(np.any(g) for g in none.values())


def test_each_adapter_exports_to_peft_on_its_own_and_loads_into_a_slot_by_name(multi_model):
  config = tiny("llama2", lora=MULTI)
  graphdef, params, rest = nnx.split(multi_model, nnx.Param, ...)
  flat = _flat(params)
  paths = {"/".join(map(str, p)): p for p, _ in nnx.to_flat_state(params)}
  emptied = {k: jnp.zeros_like(v) if k.endswith(("lora_a", "lora_b")) else v for k, v in flat.items()}
  toks = tokens(batch=3, seed=5)
  for slot, name in ((1, "bob"), (2, "carol")):
    single_config = single_adapter_config(config, name)
    adapter = slot_params(flat, config, name)
    tensors, adapter_config = peft.to_peft({k: np.asarray(v) for k, v in adapter.items()}, single_config)
    assert adapter_config["r"] == single_config.lora.lora_rank == (1 if name == "bob" else 2)
    shapes = {k: tuple(v.shape) for k, v in adapter.items()}
    back = peft.from_peft(tensors, single_config, shapes)
    loaded = put_slot(emptied, back, config, name)  # into a model whose adapters are all zero
    model = nnx.merge(graphdef, nnx.from_flat_state({paths[k]: v for k, v in loaded.items()}), rest)
    ids = jnp.full((3,), slot, jnp.int32)
    want, _ = _loss_and_adapter_grads("multi", multi_model, toks, ids)
    got, _ = _loss_and_adapter_grads("multi", model, toks, ids)
    np.testing.assert_allclose(got, want, rtol=1e-6)
  with pytest.raises(ConfigError):
    slot_params(flat, config, "dave")


def test_one_train_step_trains_every_adapter_in_the_batch_and_no_other():
  """Step 1 trains slots 0 and 2; step 2 only slot 2. A slot without rows is not changed at all: parameters and
  optimizer moments bit-identical (no weight decay, no momentum from an earlier step), base frozen."""
  from tests.test_lora import _fixed_batch
  from tests.test_train_helpers import mesh_for, tiny_config

  config = tiny_config(num_devices=2, adam_weight_decay=0.1, lora={**MULTI, "max_lora_adapters": 3, "lora_adapters": ["a", "b:1", "c"]})
  setup = setup_lib.build(config, mesh_for(config))
  assert setup.abstract_batch["adapter_ids"].shape == (config.global_batch_size_to_train_on,)
  states = []
  with jax.set_mesh(setup.mesh):
    state = setup.init_state()
    states.append(jax.device_get(state))
    for ids in ([0, 2], [2, 2]):  # slot 1 ("b") never has a row; slot 0 only in the first step
      batch = dict(_fixed_batch(config), adapter_ids=np.asarray(ids, np.int32))
      state, metrics = setup.jit_step(state, jax.device_put(batch, setup.batch_shardings))
      assert np.isfinite(float(metrics["loss"]))
      states.append(jax.device_get(state))
  before, after, final = (_flat(s["params"]) for s in states)
  for key, value in before.items():
    if key.endswith("lora_b"):  # B starts at zero, so only B moves in the first step (A's gradient is zero)
      assert np.any(after[key][:, 0] != value[:, 0]) and np.any(after[key][:, 2] != value[:, 2]), key
    if key.endswith(("lora_a", "lora_b")):
      assert np.array_equal(after[key][:, 1], value[:, 1]) and np.array_equal(final[key][:, 1], value[:, 1]), key
      assert np.array_equal(final[key][:, 0], after[key][:, 0]), key  # slot 0 unused in step 2, despite its momentum
      assert np.any(final[key][:, 2] != after[key][:, 2]), key  # slot 2 trains on: A and B move
    else:
      assert np.array_equal(after[key], value) and np.array_equal(final[key], value), key  # the frozen base
  moments = [jax.tree_util.tree_leaves_with_path(s["opt_state"]) for s in states[1:]]
  adapter_moments = [(jax.tree_util.keystr(p), np.asarray(m1), np.asarray(m2)) for (p, m1), (_, m2) in zip(*moments) if "lora" in jax.tree_util.keystr(p)]
  assert adapter_moments
  for path, m1, m2 in adapter_moments:
    assert np.array_equal(m2[:, 0], m1[:, 0]) and not np.any(m2[:, 1]), path
    if "lora_b" in path:
      assert np.any(m1[:, 0] != 0) and np.any(m2[:, 2] != m1[:, 2]), path
