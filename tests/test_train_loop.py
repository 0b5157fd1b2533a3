"""The loop: exact resume, SIGTERM save, NaN abort, restore order, eval/early stop, profiler, metrics, CLI."""

import dataclasses
import json
import os
import re
import signal

import jax
import numpy as np
import pytest

from maxtext.errors import ConfigError
from maxtext.train import checkpoint_files, checkpointing
from maxtext.train import setup as setup_lib
from maxtext.train.__main__ import main
from maxtext.train.loop import NonFiniteLossError, _check_finite, restore_or_init, train
from tests.test_train_helpers import TINY, mesh_for, tiny_config


def _cfg(tmp, run="r", **kw):
  return tiny_config(
    num_devices=8, **{"base_output_directory": str(tmp), "run_name": run, "steps": 10, "learning_rate_schedule_steps": 10, "checkpoint_period": 100, **kw}
  )


@pytest.fixture(scope="module")
def shared_setup(tmp_path_factory):
  """One compiled step for every run below (their configs differ only in loop settings)."""
  config = _cfg(tmp_path_factory.mktemp("setup"))
  return setup_lib.build(config, mesh_for(config))


def _train(config, shared_setup, **kw):
  return train(config, setup=shared_setup, **kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shared_setup):
  tmp = tmp_path_factory.mktemp("full")
  config = _cfg(tmp, metrics_file=str(tmp / "metrics.jsonl"), enable_tensorboard=True, log_period=3)
  return config, _train(config, shared_setup)


def _same_params(a, b):
  for x, y in zip(jax.tree.leaves(jax.device_get(a["params"])), jax.tree.leaves(jax.device_get(b["params"]))):
    assert np.array_equal(x, y)


def test_resume_is_bitwise_exact(uninterrupted, shared_setup, tmp_path):
  _, full = uninterrupted
  first = _train(_cfg(tmp_path, steps=5), shared_setup)
  assert first.steps_done == 5 and os.path.isdir(tmp_path / "r" / "checkpoints" / "5" / "items")
  second = train(_cfg(tmp_path, steps=10))  # a fresh setup and compilation, as after a real restart
  assert sorted(second.losses) == [5, 6, 7, 8, 9]
  assert {**first.losses, **second.losses} == full.losses  # bitwise-equal floats
  _same_params(second.state, full.state)


def test_sigterm_finishes_the_step_saves_and_the_restart_continues(uninterrupted, shared_setup, tmp_path, capsys):
  _, full = uninterrupted

  def preempt(step):
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)

  stopped = _train(_cfg(tmp_path, async_checkpointing=True), shared_setup, on_step=preempt)
  assert stopped.stop_reason == "sigterm" and stopped.steps_done == 4
  assert "received SIGTERM: saved a checkpoint after step 3" in capsys.readouterr().out
  assert os.path.isdir(tmp_path / "r" / "checkpoints" / "4" / "items")
  resumed = _train(_cfg(tmp_path), shared_setup)
  assert min(resumed.losses) == 4 and resumed.losses[9] == full.losses[9]
  _same_params(resumed.state, full.state)


def _with_state_layouts(setup):
  """setup whose compiled step takes every multi-dimensional state array column-major: what a TPU's
  compiler_state_layouts does with the stacked kernels, forced here because XLA:CPU keeps default layouts."""
  from jax.experimental.layout import Format, Layout
  from jax.sharding import NamedSharding, PartitionSpec

  def fmt(a):
    return Format(Layout(tuple(reversed(range(a.ndim)))), a.sharding) if a.ndim >= 2 else a.sharding

  formats = jax.tree.map(fmt, setup.abstract_state)
  replicated = NamedSharding(setup.mesh, PartitionSpec())
  step = jax.jit(setup.jit_step.__wrapped__, in_shardings=(formats, setup.batch_shardings), out_shardings=(formats, replicated), donate_argnums=0)
  return dataclasses.replace(setup, jit_step=step), formats


def test_state_in_compiler_layouts_trains_saves_and_resumes_like_default_layouts(uninterrupted, shared_setup, tmp_path):
  """Init in the compiled step's layouts, save, restore (checkpoints come back in default layouts and are moved),
  evaluate: the same losses and parameters as the default-layout run."""
  _, full = uninterrupted
  setup, formats = _with_state_layouts(shared_setup)
  first = _train(_cfg(tmp_path, steps=5, eval_interval=5, eval_steps=1), setup)
  second = _train(_cfg(tmp_path, steps=10), setup)
  assert sorted(second.losses) == [5, 6, 7, 8, 9] and 4 in first.eval_losses
  assert {**first.losses, **second.losses} == full.losses  # bitwise-equal floats
  kernels = [x for x in jax.tree.leaves(second.state) if x.ndim >= 2]
  assert kernels and all(x.format.layout.major_to_minor == tuple(reversed(range(x.ndim))) for x in kernels)
  # jax 0.12's XLA:CPU may sum a column-major gradient in another order: parameters equal to the last bits of float32
  for x, y in zip(jax.tree.leaves(jax.device_get(second.state["params"])), jax.tree.leaves(jax.device_get(full.state["params"]))):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_metrics_file_tensorboard_and_log_line(uninterrupted, capsys):
  config, full = uninterrupted
  lines = [json.loads(line) for line in open(config.metrics_file)]
  assert [m["step"] for m in lines] == list(range(10))
  assert {"loss", "lr", "grad_norm", "seconds", "tflops_per_device", "tokens_per_device", "mfu", "total_weights"} <= set(lines[0])
  assert lines[3]["loss"] == full.losses[3] and lines[0]["total_weights"] == config.global_batch_size_to_train_on * config.max_target_length
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(config.tensorboard_dir))
  assert full.losses[9] < full.losses[0]


def test_params_only_and_full_state_restore(uninterrupted, shared_setup, tmp_path):
  source, full = uninterrupted
  step_dir = os.path.join(source.checkpoint_dir, "10", "items")
  for key, expect_step in (("load_parameters_path", 0), ("load_full_state_path", 10)):
    config = _cfg(tmp_path, run=key, **{key: step_dir})
    setup = dataclasses.replace(shared_setup, config=config)
    with jax.set_mesh(setup.mesh):
      state = restore_or_init(setup, checkpointing.Checkpointer(config), None, print)
    assert int(state["step"]) == expect_step
    _same_params(state, full.state)
    mu = jax.tree.leaves(state["opt_state"])
    fresh = all(not np.any(np.asarray(x)) for x in mu)
    assert fresh == (key == "load_parameters_path")  # params-only starts a fresh optimizer
    assert jax.tree.leaves(state["params"])[0].sharding == jax.tree.leaves(setup.state_shardings["params"])[0]
  with pytest.raises(ConfigError, match="does not exist"):
    checkpoint_files.restore_params(str(tmp_path / "missing"), None)


def test_nan_loss_aborts_naming_the_step_without_saving(tmp_path, capsys):
  overrides = {**TINY, "base_output_directory": tmp_path, "run_name": "nan", "steps": 6, "checkpoint_period": 1, "opt_type": "sgd"}
  overrides.update(learning_rate=1e30, gradient_clipping_threshold=0, max_num_checkpoints_to_keep=2)
  args = [f"{k}={v}" for k, v in overrides.items()]
  with pytest.raises(SystemExit) as exit_info:
    main(["configs/base.yml", *args])
  assert exit_info.value.code == NonFiniteLossError.exit_code
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: loss is nan at step ") or "grad_norm is" in err[0]
  bad_step = int(err[0].split(" at step ")[1].split(";")[0])
  saved = sorted(int(d) for d in os.listdir(tmp_path / "nan" / "checkpoints") if d.isdigit())
  assert saved and max(saved) <= bad_step  # the state after the bad step (bad_step + 1) is never written
  assert len(saved) <= 2  # max_num_checkpoints_to_keep


def test_eval_target_loss_stops_early_and_profiler_writes_a_trace(shared_setup, tmp_path, capsys):
  config = _cfg(
    tmp_path,
    eval_interval=2,
    eval_steps=2,
    eval_per_device_batch_size=2,  # eval batches twice the training batch's rows, through the same setup
    target_eval_loss=100.0,
    profiler="xplane",
    skip_first_n_steps_for_profiler=0,
    profiler_steps=1,
    enable_checkpointing=False,
  )
  result = _train(config, shared_setup)
  assert result.stop_reason == "target_eval_loss" and result.steps_done == 2 and list(result.eval_losses) == [1]
  weights = int(re.search(r"eval after step 1: .*total_weights: (\d+)", capsys.readouterr().out).group(1))
  assert weights == 2 * 2 * config.global_batch_size_to_train_on * config.max_target_length  # 2 batches of twice the rows, all real tokens
  traces = [f for _, _, files in os.walk(config.tensorboard_dir) for f in files if f.endswith(".xplane.pb")]
  assert traces
  assert not os.path.exists(config.checkpoint_dir)  # enable_checkpointing=false


def test_config_errors_are_one_line(tmp_path):
  with pytest.raises(ConfigError, match="hardware=tpu"):
    train(_cfg(tmp_path, hardware="tpu"))
  with pytest.raises(ConfigError, match="eval_steps"):
    train(_cfg(tmp_path, eval_interval=2))


@pytest.mark.parametrize(
  "value, nan_flag, inf_flag, aborts",
  [(float("nan"), True, False, True), (float("inf"), False, True, True), (float("inf"), True, False, False), (float("nan"), False, True, False)],
)
def test_abort_flags(value, nan_flag, inf_flag, aborts):
  config = tiny_config(num_devices=1, abort_on_nan_loss=nan_flag, abort_on_inf_loss=inf_flag)
  metrics = {"loss": value, "grad_norm": 1.0}
  if aborts:
    with pytest.raises(NonFiniteLossError, match="at step 7"):
      _check_finite(config, 7, metrics)
  else:
    _check_finite(config, 7, metrics)
