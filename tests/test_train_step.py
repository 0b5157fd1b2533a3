"""The jitted train step: gradient accumulation equals the big batch; 8-device sharding gives the 1-device loss curve."""

import jax
import numpy as np
import pytest

from maxtext import models
from maxtext.data.synthetic import SyntheticIterator
from maxtext.train import optimizers
from maxtext.train import setup as setup_lib
from maxtext.train import state as state_lib
from tests.test_train_helpers import mesh_for, tiny_config


@pytest.fixture(scope="module")
def sharded():
  config = tiny_config(num_devices=8, dtype="float32", per_device_batch_size=1, ici_fsdp_parallelism=4, ici_tensor_parallelism=2)
  return _run(config, steps=3)


def _run(config, steps):
  mesh = mesh_for(config)
  setup = setup_lib.build(config, mesh)
  data = SyntheticIterator(config, mesh)
  with jax.set_mesh(mesh):
    state = setup.init_state()
    losses = []
    for _ in range(steps):
      state, metrics = setup.jit_step(state, next(data))
      losses.append(float(metrics["loss"]))
  return losses, jax.device_get(state["params"]), setup, state


@pytest.fixture(scope="module")
def one_device():
  return _run(tiny_config(num_devices=1, dtype="float32", per_device_batch_size=8), steps=3)


def test_a_second_build_in_one_process_runs_with_the_tpu_policy():
  """remat_policy=auto compiles the step several times in one process: no array one trace made (the splash
  kernel's mask) may leak into the next as a hoisted constant, or the last compiled step refuses its inputs."""
  import dataclasses

  from maxtext import platform

  config = tiny_config(num_devices=1, max_target_length=256, attention="flash")
  mesh = mesh_for(config)
  policy = platform.for_platform(config, "tpu", interpret=True)  # splash in interpret mode, state layouts by XLA
  with jax.set_mesh(mesh):
    first = setup_lib.build(config, mesh, policy=policy).compiled_step
    setup = setup_lib.build(config, mesh, policy=dataclasses.replace(policy))
    step = setup.compiled_step
    state = setup.init_state(state_lib.compiled_formats(step))
    _, metrics = step(state, next(SyntheticIterator(config, mesh)))
  assert np.isfinite(float(metrics["loss"])) and first is not step


def test_gradient_accumulation_equals_the_big_batch(one_device):
  # skip_step_on_spikes is on here too: with a window not yet full nothing is skipped, so results must not change.
  config = tiny_config(num_devices=1, dtype="float32", per_device_batch_size=2, gradient_accumulation_steps=4, skip_step_on_spikes=True, skip_step_interval=8)
  accumulated = _run(config, steps=3)
  np.testing.assert_allclose(accumulated[0], one_device[0], rtol=2e-5)
  for a, b in zip(jax.tree.leaves(accumulated[1]), jax.tree.leaves(one_device[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)


def test_eight_sharded_devices_follow_the_one_device_loss_curve(one_device, sharded):
  losses, params, setup, _ = sharded
  np.testing.assert_allclose(losses, one_device[0], rtol=2e-5)
  assert losses[-1] < losses[0]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_device[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)
  specs = {str(s.spec) for s in jax.tree.leaves(setup.state_shardings["params"])}
  assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs)  # parameters really are sharded


def test_optimizer_state_in_host_memory_trains_like_on_device_and_checkpoints(sharded, tmp_path):
  """optimizer_memory_host_offload: the optimizer state lives in pinned host memory between steps (parameters stay on
  the device), three sharded steps follow the on-device run, and a checkpoint restores it into host memory."""
  from maxtext.train.checkpointing import Checkpointer

  config = tiny_config(
    num_devices=8, dtype="float32", per_device_batch_size=1, ici_fsdp_parallelism=4, ici_tensor_parallelism=2, optimizer_memory_host_offload=True
  )
  losses, params, setup, state = _run(config.model_copy(update={"base_output_directory": str(tmp_path), "run_name": "off"}), steps=3)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state["opt_state"])} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state["params"])} == {"device"}
  np.testing.assert_allclose(losses, sharded[0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sharded[1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  checkpointer = Checkpointer(setup.config)
  checkpointer.save(3, state, None)
  checkpointer.wait()
  with jax.set_mesh(setup.mesh):
    restored = checkpointer.restore_latest(setup.abstract_state, log=lambda _: None).state
  for got, saved in zip(jax.tree.leaves(restored["opt_state"]), jax.tree.leaves(state["opt_state"]), strict=True):
    assert got.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(got, saved)


def test_optimizer_state_split_over_data_trains_like_the_fsdp_run(sharded):
  """shard_optimizer_over_data (ZeRO-1) on data 2 x fsdp 2 x tensor 2: every optimizer-state array with a dimension
  the axes divide is split over `data` too, parameters are not, and three steps follow the fsdp 4 x tensor 2 run."""
  config = tiny_config(
    num_devices=8,
    dtype="float32",
    per_device_batch_size=1,
    ici_data_parallelism=2,
    ici_fsdp_parallelism=2,
    ici_tensor_parallelism=2,
    shard_optimizer_over_data=True,
  )
  losses, params, setup, state = _run(config, steps=3)
  names = lambda tree: [str(x.sharding.spec) for x in jax.tree.leaves(tree) if x.ndim]  # noqa: E731
  assert all("data" in s for s in names(state["opt_state"])) and not any("data" in s for s in names(state["params"]))
  np.testing.assert_allclose(losses, sharded[0], rtol=2e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sharded[1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)


def test_abstract_state_and_batch_lower_with_explicit_shardings(sharded):
  setup = sharded[2]
  leaves = jax.tree.leaves(setup.abstract_state)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None for x in leaves)
  assert setup.abstract_batch["inputs"].shape == (setup.config.global_batch_size_to_train_on, setup.config.max_target_length)
  lowered = setup.jit_step.lower(setup.abstract_state, setup.abstract_batch)
  assert "fsdp" in lowered.as_text()  # parameter shardings are part of the program
  state_info, batch_info = lowered.args_info[0]
  assert all(a.donated for a in jax.tree.leaves(state_info)) and not any(a.donated for a in jax.tree.leaves(batch_info))


def test_init_weights_seed_changes_the_initial_parameters():
  params = []
  for seed in (0, 1):
    config = tiny_config(num_devices=1, base_num_decoder_layers=1, init_weights_seed=seed)
    init = state_lib.make_init_fn(config, models.build, optimizers.build(config), config.init_weights_seed)
    params.append(jax.jit(lambda init=init: init()["params"])())
  a, b = (jax.tree.leaves(p) for p in params)
  assert not np.array_equal(a[0], b[0])


def _is_first_moment(path) -> bool:
  return "mu" in [getattr(k, "name", None) for k in path]  # optax's ScaleByAdamState.mu


def _first_moments(opt_state) -> list:
  """The leaves of AdamW's first moment in an optimizer state."""
  return [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0] if _is_first_moment(path)]


def test_a_bfloat16_first_moment_trains_like_float32_and_checkpoints_either_way(one_device, tmp_path):
  """mu_dtype=bfloat16: AdamW's first moment is stored in bfloat16, three steps follow the float32 run closely, and a
  checkpoint of that state restores as it is and into a float32-moment state (orbax casts to the restoring state's dtype)."""
  from maxtext.train.checkpointing import Checkpointer

  config = tiny_config(num_devices=1, dtype="float32", per_device_batch_size=8, mu_dtype="bfloat16", base_output_directory=str(tmp_path), run_name="mu")
  losses, params, setup, state = _run(config, steps=3)
  mu = _first_moments(state["opt_state"])
  assert mu and {x.dtype.name for x in mu} == {"bfloat16"}
  np.testing.assert_allclose(losses, one_device[0], rtol=1e-3)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_device[1]), strict=True):
    assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b)
  checkpointer = Checkpointer(config)
  checkpointer.save(3, state, None)
  as_float32 = jax.tree_util.tree_map_with_path(  # the state a run with the default mu_dtype (float32 weights) restores into
    lambda path, x: jax.ShapeDtypeStruct(x.shape, jax.numpy.float32, sharding=x.sharding) if _is_first_moment(path) else x, setup.abstract_state
  )
  for target, want in ((setup.abstract_state, "bfloat16"), (as_float32, "float32")):
    with jax.set_mesh(setup.mesh):
      restored = checkpointer.restore_latest(target, log=lambda _: None).state
    for got, saved in zip(_first_moments(restored["opt_state"]), mu, strict=True):
      assert got.dtype.name == want
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(saved, np.float32))
