"""DiLoCo (enable_diloco): with H=1, outer lr 1 and no momentum it is plain data parallelism; between syncs the groups
exchange nothing, and a sync moves as many bytes between groups as one plain data-parallel step; bad keys are one line."""

import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from maxtext.train import diloco
from maxtext.train import setup as setup_lib
from maxtext.train.loop import create_data_iterator
from tests.test_bad_inputs import _env, _train, assert_one_line_exit_2
from tests.test_train_helpers import FAST_COMPILE, mesh_for, tiny_config
from tests.xla_env import xla_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from hlo_cross_group import cross_group_bytes  # noqa: E402

STEPS = 3
# Linear inner updates (SGD, no clipping): the mean of the groups' steps is then the step on the whole batch.
COMMON = dict(opt_type="sgd", gradient_clipping_threshold=0.0, steps=STEPS, learning_rate_schedule_steps=STEPS, base_output_directory="/unused")


def _compiled(setup):
  return setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile(compiler_options=FAST_COMPILE)


@pytest.fixture(scope="module")
def runs():
  """Plain data parallelism (data 2 x fsdp 2) and DiLoCo (2 groups x fsdp 2, H=1, outer lr 1, momentum 0), 3 steps each on the same batches."""
  plain = tiny_config(num_devices=4, ici_data_parallelism=2, **COMMON)
  grouped = tiny_config(
    num_devices=4, enable_diloco=True, ici_diloco_parallelism=2, diloco_sync_period=1, diloco_outer_lr=1.0, diloco_outer_momentum=0.0, **COMMON
  )
  out, start = {}, None
  for name, config in (("plain", plain), ("diloco", grouped)):
    mesh = mesh_for(config)
    setup = setup_lib.build(config, mesh)
    compiled = _compiled(setup)
    with jax.set_mesh(mesh):
      state, it, losses = setup.init_state(), create_data_iterator(config, mesh, "train"), []
      # Both runs start from the plain run's initial weights: the two meshes' init programs, compiled with the tests'
      # fast-compile flags (tests/xla_env.py), may differ in the last bit.
      if start is None:
        start = jax.device_get(state["params"])
      else:
        state["params"] = jax.tree.map(lambda w, x: jax.device_put(w, x.sharding), start, state["params"])
        inner = state[diloco.INNER]["params"]
        state[diloco.INNER]["params"] = jax.tree.map(lambda w, x: jax.device_put(np.broadcast_to(w, x.shape), x.sharding), start, inner)
      for _ in range(STEPS):
        state, metrics = compiled(state, next(it))
        fetched = diloco.host_metrics(jax.device_get(metrics))
        assert fetched["total_weights"] == config.global_batch_size_to_train_on * config.max_target_length  # summed over the groups
        losses.append(fetched["loss"])
    out[name] = (config, compiled, state, losses)
  return out


def test_sync_every_step_with_outer_lr_1_is_plain_data_parallelism(runs):
  _, _, plain, plain_losses = runs["plain"]
  config, _, grouped, losses = runs["diloco"]
  assert diloco.groups(config) == 2 and config.mesh_axes[0] == "diloco" and config.data_sharding[0] == "diloco"
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(plain["params"]), jax.tree.leaves(grouped["params"]), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
  for a, b in zip(jax.tree.leaves(grouped["params"]), jax.tree.leaves(grouped[diloco.INNER]["params"]), strict=True):
    assert b.shape == (2, *a.shape) and np.array_equal(np.asarray(b[1]), np.asarray(a))  # every group restarted from the global parameters


def test_groups_exchange_bytes_only_at_the_sync(runs):
  """Per step, DiLoCo's traffic between groups is at most 1/H of plain data parallelism's: none in the inner step, and
  the sync (a conditional taken every H-th step) moves each device's float32 parameter shards once, no more than one
  plain step moves between the same device groups."""
  plain = cross_group_bytes(runs["plain"][1].as_text(), group_size=2)
  config, compiled, state, _ = runs["diloco"]
  grouped = cross_group_bytes(compiled.as_text(), group_size=2)
  shards = sum(4 * math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(state["params"]))
  assert plain["every_step"] > 0 and plain["in_branches"] == 0
  assert grouped == {"every_step": 0, "in_branches": shards}, (grouped, shards)
  assert grouped["in_branches"] <= plain["every_step"], (plain, grouped)


@pytest.mark.parametrize(
  "keys, expected",
  [
    (["enable_diloco=true"], "enable_diloco=true needs at least 2 DiLoCo groups"),
    (["ici_diloco_parallelism=2", "ici_fsdp_parallelism=2"], "splits replicas into DiLoCo groups, but enable_diloco is false"),
    (["enable_diloco=true", "ici_diloco_parallelism=2", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=1"], "enable_diloco with pipeline parallelism"),
  ],
  ids=["no_diloco_axis", "axis_without_enable_diloco", "with_pipeline"],
)
def test_bad_diloco_keys_are_one_line_exit_2(keys, expected, tmp_path):
  argv = [a.replace("{tmp}", str(tmp_path)) for a in _train(*keys)]
  env = dict(_env(), XLA_FLAGS=xla_flags(4))
  proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
  assert_one_line_exit_2(proc, expected)
  assert list(tmp_path.iterdir()) == []  # nothing written
