"""LoRA: adapters (scanned and unscanned), identity at init, counts, frozen base, optimizer state,
mHC + LoRA training, n = 4 training, adapter-only checkpoints, resume, restores and one-line errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import models
from maxtext.config import ConfigError
from maxtext.convert.model_params import flat_params
from maxtext.counting import param_count
from maxtext.layers.lora import LoRAParam, merge
from maxtext.layers.mhc import MHCParam
from maxtext.train import checkpoint_files, initial_params
from maxtext.train import setup as setup_lib
from maxtext.train import state as state_lib
from maxtext.train import trainable as trainable_lib
from maxtext.train.loop import restore_or_init, train
from tests.test_mhc import jit_logits
from tests.test_models import FAMILY_OVERRIDES, tiny, tokens
from tests.test_train_helpers import mesh_for, tiny_config

LORA = {"enable_lora": True, "lora_rank": 2, "lora_alpha": 4.0}


def _flat(state) -> dict[str, np.ndarray]:
  return {"/".join(map(str, p)): np.asarray(jax.device_get(v.get_value())) for p, v in nnx.to_flat_state(state)}


def _of_type(state, kind) -> dict[str, np.ndarray]:
  return _flat(nnx.filter_state(state, kind))


@pytest.mark.parametrize("family", list(FAMILY_OVERRIDES))
def test_param_count_matches_counting(family):
  paths = (None, "attention/(query|value)$", "mlp/gate$" if family == "mixtral" else "mlp/wo$")
  for i, path in enumerate(paths):
    lora = {**LORA, **({"lora_module_path": path} if path else {})}
    config = tiny(family, lora=lora, scan_layers=i != 1, mhc_expansion_rate=2 if i == 2 else 1)
    state = nnx.state(models.abstract_model(config))
    assert sum(np.prod(v.shape) for _, v in nnx.to_flat_state(state)) == param_count(config), (family, path)


def test_adapters_scanned_and_unscanned_with_axes():
  for scan in (True, False):
    config = tiny("llama2", scan_layers=scan, lora={**LORA, "lora_module_path": "attention/(query|out)$"})
    state = nnx.state(models.abstract_model(config))
    adapters = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(state) if isinstance(v, LoRAParam)}
    prefix = "layers" if scan else "layers/1"
    lead = (2,) if scan else ()
    assert len(adapters) == 2 * 2 * (1 if scan else 2)
    assert adapters[f"{prefix}/attention/query/lora/lora_a"].shape == lead + (32, 2)
    assert adapters[f"{prefix}/attention/query/lora/lora_b"].shape == lead + (2, 4, 8)
    assert adapters[f"{prefix}/attention/out/lora/lora_a"].shape == lead + (4, 8, 2)
    axes = adapters[f"{prefix}/attention/query/lora/lora_b"].get_metadata()["logical_axes"]
    assert axes == (("layers",) if scan else ()) + (None, "heads", "head_dim")


def test_identity_at_init_base_unchanged_and_merge():
  plain = models.build(tiny("qwen3", scan_layers=False))
  adapted = models.build(tiny("qwen3", scan_layers=False, lora=LORA))
  base, full = flat_params(plain), flat_params(adapted)
  assert all(np.array_equal(base[k], full[k]) for k in base)  # adapters draw keys without shifting the base's
  b = {k: v for k, v in full.items() if k.endswith("lora_b")}
  assert b and not any(np.any(v) for v in b.values())
  assert np.abs(np.asarray(full["layers/0/attention/query/lora/lora_a"])).max() <= 1 / np.sqrt(32)
  toks = tokens()
  np.testing.assert_allclose(jit_logits(adapted, toks), jit_logits(plain, toks), atol=1e-5, rtol=0)
  # The adapter computes (alpha / r) x A B, which merge() folds into the kernel exactly.
  dense = adapted.layers[0].attention.query
  dense.lora.lora_b.set_value(jax.random.normal(jax.random.key(1), dense.lora.lora_b.shape))
  x = jax.random.normal(jax.random.key(2), (3, 32))
  merged = merge(dense.kernel[...], dense.lora.lora_a[...], dense.lora.lora_b[...], 4.0 / 2)
  np.testing.assert_allclose(np.asarray(dense(x)), np.asarray(jnp.einsum("be,ehd->bhd", x, merged)), atol=1e-5)


def test_module_regex_matching_nothing_is_a_one_line_error(capsys):
  with pytest.raises(ConfigError, match=r"matches no module; available module paths: attention/key, attention/out") as e:
    models.abstract_model(tiny("llama2", lora={**LORA, "lora_module_path": "self_attn"}))
  assert "\n" not in str(e.value) and "mlp/wi_0" in str(e.value)
  from maxtext.train.__main__ import main

  with pytest.raises(SystemExit) as exit_info:
    main(["configs/base.yml", "lora.enable_lora=true", "lora.lora_module_path=nothing$", "steps=1", "dataset_type=synthetic"])
  err = capsys.readouterr().err.strip().splitlines()
  assert exit_info.value.code == 2 and len(err) == 1 and "matches no module" in err[0]
  with pytest.raises(SystemExit) as exit_info:
    main(["configs/base.yml", "lora.lora_rank=0"])
  assert exit_info.value.code == 2 and "lora.lora_rank" in capsys.readouterr().err


def _fixed_batch(config):
  rows, length = config.global_batch_size_to_train_on, config.max_target_length
  toks = jax.random.randint(jax.random.key(0), (rows, length + 1), 1, config.vocab_size, jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
  seg = jnp.ones((rows, length), jnp.int32)
  return {
    "inputs": toks[:, :-1],
    "targets": toks[:, 1:],
    "inputs_position": pos,
    "targets_position": pos,
    "inputs_segmentation": seg,
    "targets_segmentation": seg,
  }


def _run_steps(config, steps):
  setup = setup_lib.build(config, mesh_for(config))
  with jax.set_mesh(setup.mesh):
    state = setup.init_state()
    start = jax.device_get(state)
    batch = jax.device_put(_fixed_batch(config), setup.batch_shardings)
    losses = []
    for _ in range(steps):
      state, metrics = setup.jit_step(state, batch)
      losses.append(float(metrics["loss"]))
  return start, jax.device_get(state), losses


def test_training_with_four_streams_lowers_the_loss():
  config = tiny_config(num_devices=1, mhc_expansion_rate=4, dtype="bfloat16", learning_rate=3e-3)
  start, end, losses = _run_steps(config, 8)
  assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5
  moved = _of_type(end["params"], MHCParam)
  assert any(not np.array_equal(v, _of_type(start["params"], MHCParam)[k]) for k, v in moved.items())


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
  """A base params checkpoint (no adapters, no connectors), and a LoRA + mHC (n = 2) run on it
  (4 steps, checkpoints at 2 and 4; resumed from 2 once)."""
  tmp = tmp_path_factory.mktemp("lora")
  kw = dict(base_output_directory=str(tmp), steps=4, checkpoint_period=2, learning_rate_schedule_steps=4, load_parameters_path=str(tmp / "base"))
  config = tiny_config(run_name="lora", lora=LORA, mhc_expansion_rate=2, **kw)
  setup = setup_lib.build(config, mesh_for(config))
  with jax.set_mesh(setup.mesh):
    _, frozen = trainable_lib.split_params(setup.init_state()["params"], config)
  base = jax.tree.map(lambda x: 1.5 * x + 0.01, frozen)  # a plain model's parameters, unlike the seeded init
  checkpoint_files.save_params(str(tmp / "base"), base)
  full = train(config, setup=setup)
  import shutil

  shutil.copytree(tmp / "lora" / "checkpoints", tmp / "resumed" / "checkpoints")
  shutil.rmtree(tmp / "resumed" / "checkpoints" / "4")
  resumed = train(tiny_config(run_name="resumed", lora=LORA, mhc_expansion_rate=2, **kw), setup=setup)
  return tmp, _flat(base), setup, full, resumed


def test_lora_with_mhc_trains_adapters_and_connectors_beside_a_frozen_base(lora_runs):
  tmp, base, setup, full, _ = lora_runs
  assert np.isfinite(list(full.losses.values())).all()
  params = _flat(full.state["params"])
  assert all(np.array_equal(base[k], params[k]) for k in base)  # every base parameter bit-identical
  with jax.set_mesh(setup.mesh):
    init = jax.device_get(setup.init_state()["params"])
  for kind in (LoRAParam, MHCParam):
    a, b = _of_type(init, kind), _of_type(full.state["params"], kind)
    assert a and any(not np.array_equal(a[k], b[k]) for k in a), kind
  trainable = _of_type(full.state["params"], nnx.Any(LoRAParam, MHCParam))
  opt_bytes = sum(x.nbytes for x in jax.tree.leaves(jax.device_get(full.state["opt_state"])))
  assert opt_bytes <= 2 * sum(v.nbytes for v in trainable.values()) + 64  # Adam moments for adapters + connectors only


def test_lora_checkpoints_hold_only_trainable_params_and_resume_exactly(lora_runs):
  tmp, base, _, full, resumed = lora_runs
  shapes = checkpoint_files.param_shapes(str(tmp / "lora" / "checkpoints" / "4"))
  trainable = _of_type(full.state["params"], nnx.Any(LoRAParam, MHCParam))
  assert sorted(shapes) == sorted(trainable) and all(shapes[k] == trainable[k].shape for k in shapes)
  assert sorted(resumed.losses) == [2, 3] and resumed.losses[3] == full.losses[3]
  params = _flat(resumed.state["params"])
  assert base and all(np.array_equal(base[k], params[k]) for k in base)  # base again from load_parameters_path
  assert all(np.array_equal(trainable[k], params[k]) for k in trainable)


def test_lora_restore_path_and_wrong_shape(lora_runs):
  tmp, _, setup, full, _ = lora_runs
  ckpt = str(tmp / "lora" / "checkpoints" / "4")
  restore_cfg = tiny_config(run_name="restore", base_output_directory=str(tmp), mhc_expansion_rate=2, lora={**LORA, "lora_restore_path": ckpt})
  with jax.set_mesh(setup.mesh):
    state = restore_or_init(dataclasses.replace(setup, config=restore_cfg), None, None, print)
  assert int(state["step"]) == 0
  a, b = (_of_type(s["params"], nnx.Any(LoRAParam, MHCParam)) for s in (full.state, state))
  assert all(np.array_equal(a[k], b[k]) for k in a)
  wrong = tiny_config(mhc_expansion_rate=2, lora={**LORA, "lora_rank": 3, "lora_restore_path": ckpt})
  abstract = nnx.state(models.abstract_model(wrong), nnx.Param)
  with pytest.raises(ConfigError, match=r"lora.lora_restore_path .* with shape \(2, 32, 2\), this model needs \(2, 32, 3\)") as e:
    initial_params.load_initial_params(wrong, None, abstract, print)
  assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="needs lora.enable_lora=true"):
    initial_params.load_initial_params(tiny_config(lora={"lora_restore_path": ckpt}), None, abstract, print)


def test_checkpointed_view_and_trainable_filter():
  assert trainable_lib.trainable_filter(tiny_config()) is nnx.Param
  assert trainable_lib.trainable_filter(tiny_config(lora=LORA)) is LoRAParam
  state = {"step": 0, "params": nnx.state(models.abstract_model(tiny_config(lora=LORA, mhc_expansion_rate=2)))}
  kept = state_lib.checkpointed(state, tiny_config(lora=LORA, mhc_expansion_rate=2))["params"]
  kinds = {type(v) for _, v in nnx.to_flat_state(kept)}
  assert kinds == {LoRAParam, MHCParam}
  assert state_lib.checkpointed(state, tiny_config()) is state
