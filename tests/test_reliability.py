"""Reliability in process: the run lock, restore fallback, output errors, the memory check, signals in eval and
before the first step, the schedule warning and metrics flushed at checkpoints (the CLI side: test_bad_inputs.py,
test_preemption.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from maxtext import memory_limit
from maxtext.aot import memory
from maxtext.errors import ConfigError
from maxtext.train import checkpointing, outputs, preflight, run_lock
from maxtext.train import loop as loop_lib
from maxtext.train import setup as setup_lib
from maxtext.train.loop import train
from maxtext.train.preemption import Preemption
from tests.test_train_helpers import mesh_for, tiny_config

# Restoring a damaged checkpoint (the fallback tests) makes Orbax abandon the sibling array reads of the one that
# failed; their coroutines and TensorStore callbacks then raise while being collected (maxtext.errors.ABANDONED_READ_NOISE,
# which the CLIs drop). pytest would report each as a PytestUnraisableExceptionWarning; nothing of ours is unawaited.
pytestmark = [
  pytest.mark.filterwarnings(r"ignore:Exception ignored in. <coroutine object _read_array_index_and_device_put:pytest.PytestUnraisableExceptionWarning"),
  pytest.mark.filterwarnings(r"ignore:Exception ignored in. None[\s\S]*Event loop is closed:pytest.PytestUnraisableExceptionWarning"),
]


def _cfg(tmp, run="r", **kw):
  base = {"base_output_directory": str(tmp), "run_name": run, "steps": 4, "learning_rate_schedule_steps": 4, "checkpoint_period": 2}
  return tiny_config(num_devices=1, **{**base, **kw})


@pytest.fixture(scope="module")
def shared_setup(tmp_path_factory):
  config = _cfg(tmp_path_factory.mktemp("setup"))
  return setup_lib.build(config, mesh_for(config))


def _same_params(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(a["params"])), jax.tree.leaves(jax.device_get(b["params"])), strict=True))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, shared_setup):
  """A finished run with checkpoints 2 and 4, copied fresh by each test that damages it."""
  tmp = tmp_path_factory.mktemp("good")
  config = _cfg(tmp)
  result = train(config, setup=shared_setup)
  return tmp, result


def _copy(src, tmp_path):
  shutil.copytree(src, tmp_path, dirs_exist_ok=True)
  return tmp_path


# --- the run lock ---------------------------------------------------------------------------------------------


def test_second_lock_is_refused_naming_the_holder(tmp_path):
  first = run_lock.RunLock(str(tmp_path))
  first.acquire()
  try:
    with pytest.raises(run_lock.RunLockedError, match=rf"in use by another run \(host {socket.gethostname()} pid {os.getpid()} "):
      run_lock.RunLock(str(tmp_path)).acquire()
  finally:
    first.release()
  assert not os.path.exists(tmp_path / run_lock.LOCK_NAME)
  second = run_lock.RunLock(str(tmp_path))
  second.acquire()  # free again once released
  second.release()


def test_lock_of_a_dead_process_is_taken_over(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "then"}))
  said = []
  lock = run_lock.RunLock(str(tmp_path), said.append)
  lock.acquire()
  assert len(said) == 1 and f"pid {dead.pid}" in said[0] and "no longer running" in said[0]
  assert json.loads((tmp_path / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
  lock.release()


def test_lock_of_a_live_process_without_flock_and_of_another_host(tmp_path):
  live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid}))
    with pytest.raises(run_lock.RunLockedError, match=f"pid {live.pid}"):
      run_lock.RunLock(str(tmp_path)).acquire()
  finally:
    live.kill()
    live.wait()
  path = tmp_path / run_lock.LOCK_NAME
  path.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
  with pytest.raises(run_lock.RunLockedError, match="host elsewhere pid 1"):
    run_lock.RunLock(str(tmp_path)).acquire()  # a fresh heartbeat from another host: alive
  old = time.time() - run_lock.STALE_SECONDS - 1
  os.utime(path, (old, old))
  lock = run_lock.RunLock(str(tmp_path), lambda _: None)
  lock.acquire()  # its heartbeat stopped: taken over
  lock.release()


def test_train_refuses_a_locked_run_directory_before_writing(tmp_path, shared_setup):
  config = _cfg(tmp_path)
  holder = run_lock.RunLock(os.path.join(str(tmp_path), "r"))
  holder.acquire()
  try:
    with pytest.raises(run_lock.RunLockedError, match="in use by another run"):
      train(config, setup=shared_setup)
  finally:
    holder.release()
  assert not os.path.exists(tmp_path / "r")  # the holder's lock made it and removed it, so train wrote nothing into it


# --- restore falls back -----------------------------------------------------------------------------------------


def _restore(config, setup, said, data_iter=None):
  ckpt = checkpointing.Checkpointer(config)
  try:
    restored = ckpt.restore_latest(loop_lib.state_lib.checkpointed(setup.abstract_state, config), said.append, data_iter)
  finally:
    ckpt.close()
  return restored


@pytest.mark.parametrize("damage", ["empty_newer_step", "truncated_arrays", "no_array_data", "wrong_step_inside"])
def test_damaged_newest_checkpoint_falls_back_and_is_kept_aside(two_checkpoints, shared_setup, tmp_path, damage):
  src, _ = two_checkpoints
  _copy(src, tmp_path)
  ckpts = tmp_path / "r" / "checkpoints"
  bad = ckpts / "4"
  if damage == "empty_newer_step":
    bad = ckpts / "5"
    bad.mkdir()
  elif damage == "truncated_arrays":  # the largest array data file cut short; metadata intact
    data = max((f for f in (bad / "items").rglob("*") if f.is_file() and "ocdbt.process_" in str(f)), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:1000])
  elif damage == "no_array_data":  # commit marker and metadata, no arrays
    shutil.rmtree(bad / "items" / "d")
    for f in (bad / "items").glob("ocdbt.process_*"):
      shutil.rmtree(f)
  else:  # step 4's directory holds step 2's state
    shutil.rmtree(bad)
    shutil.copytree(ckpts / "2", bad)
  config = _cfg(tmp_path)
  said = []
  state = _restore(config, shared_setup, said).state
  expect = 4 if damage == "empty_newer_step" else 2
  assert int(state["step"]) == expect
  assert len(said) == 1 and f"checkpoint {bad} is unusable" in said[0] and "moved it to" in said[0]
  reason = {"truncated_arrays": "its arrays do not restore", "wrong_step_inside": "its state is at step 2", "empty_newer_step": "no readable metadata"}
  assert reason.get(damage, "") in said[0]
  assert not bad.exists() and len(list(ckpts.glob(f"{bad.name}.unusable-*"))) == 1  # kept, not deleted


def test_checkpoints_of_another_model_are_an_error_and_nothing_moves(two_checkpoints, tmp_path):
  src, _ = two_checkpoints
  _copy(src, tmp_path)
  config = _cfg(tmp_path, base_mlp_dim=128)
  setup = setup_lib.build(config, mesh_for(config))  # abstract: nothing compiles
  with pytest.raises(ConfigError, match=r"hold 'params/.*' with shape .* this config needs"):
    preflight.check_restore_paths(config, setup, loop_lib.state_lib.checkpointed(setup.abstract_state, config))
  assert sorted(os.listdir(tmp_path / "r" / "checkpoints")) == ["2", "4", "data_iterator"]


# --- outputs ------------------------------------------------------------------------------------------------------


def test_output_checks_name_the_path_and_the_bytes(tmp_path, monkeypatch):
  (tmp_path / "file").write_text("x")
  with pytest.raises(outputs.OutputError, match="not a directory"):
    outputs.check_writable(str(tmp_path / "file" / "run"), 10, "checkpoint_dir")
  monkeypatch.setattr(outputs.shutil, "disk_usage", lambda _: types.SimpleNamespace(free=1000))
  with pytest.raises(outputs.OutputError, match=r"needs 5 KiB \(5000 bytes\) but .* has 1000 bytes free"):
    outputs.check_writable(str(tmp_path / "run"), 5000, "checkpoint_dir")
  monkeypatch.setattr(outputs.os, "access", lambda *_: False)  # what a read-only mount reports (root ignores chmod)
  with pytest.raises(outputs.OutputError, match="cannot be written"):
    outputs.check_writable(str(tmp_path / "run"), 0, "checkpoint_dir")
  err = outputs.as_user_error(ValueError("tensorstore: write failed: No space left on device [errno 28]"), "/ckpt", 2**30, "a checkpoint")
  assert err is not None and "/ckpt is full" in str(err) and "1.00 GiB" in str(err)
  assert outputs.as_user_error(RuntimeError("boom"), "/ckpt", 1, "x") is None


def test_disk_full_mid_run_is_one_line_and_keeps_the_previous_checkpoint(two_checkpoints, shared_setup, tmp_path, monkeypatch):
  """Simulated: the second save raises ENOSPC as a full disk would (a real tmpfs needs root to mount)."""
  src, full = two_checkpoints
  real_save, calls = checkpointing.Checkpointer.save, []

  def save(self, step, state, data_state):
    calls.append(step)
    if len(calls) == 2:
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_save(self, step, state, data_state)

  monkeypatch.setattr(checkpointing.Checkpointer, "save", save)
  with pytest.raises(outputs.OutputError, match=r"is full; it needs .* bytes\) free\. Earlier checkpoints are intact"):
    train(_cfg(tmp_path), setup=shared_setup)
  assert not os.path.exists(tmp_path / "r" / "run.lock")
  monkeypatch.setattr(checkpointing.Checkpointer, "save", real_save)
  resumed = train(_cfg(tmp_path), setup=shared_setup)
  assert min(resumed.losses) == 2 and _same_params(resumed.state, full.state)


def test_metrics_file_that_cannot_be_created_is_one_line(tmp_path, monkeypatch, shared_setup):
  """The writer's own translation (the preflight check, which would catch this first, is switched off)."""
  (tmp_path / "file").write_text("x")
  config = _cfg(tmp_path, metrics_file=str(tmp_path / "file" / "metrics.jsonl"), enable_checkpointing=False)
  monkeypatch.setattr(outputs, "check_writable", lambda *a, **k: None)
  with pytest.raises(outputs.OutputError, match=r"writing metrics_file failed: .*file is a regular file where a directory is needed"):
    train(config, setup=shared_setup)


# --- memory fit -----------------------------------------------------------------------------------------------------


def test_a_step_that_does_not_fit_is_refused_with_the_numbers(shared_setup, monkeypatch):
  config = shared_setup.config
  preflight.check_memory_fit(config, shared_setup.compiled_step)  # the tiny step fits
  need = memory.step_bytes(shared_setup.compiled_step)
  assert need is not None and 0 < need[1] <= need[0]
  monkeypatch.setattr(memory_limit, "limit_per_device", lambda: memory_limit.Limit(need[0] // 2, "test memory"))
  with pytest.raises(
    ConfigError, match=r"needs .* GiB per device .* but test memory leaves .*; lower per_device_batch_size \(1.0\) or max_target_length \(16\)"
  ):
    preflight.check_memory_fit(config, shared_setup.compiled_step)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_cgroup_memory_limit_counts_at_every_level(tmp_path, version):
  """The tightest limit of the process's cgroup and its parents, less what is used (page cache that can be reclaimed
  counts as free). (RLIMIT_AS, which a process can set on itself, is tested for real in tests/test_run_ends.py.)"""
  files = {"v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"), "v2": ("memory.max", "memory.current", "inactive_file")}
  limit, usage, reclaimable = files[version]
  base = tmp_path / ("memory" if version == "v1" else "")
  leaf, parent = base / "jobs" / "job7", base / "jobs"
  leaf.mkdir(parents=True)
  (leaf / limit).write_text("max\n" if version == "v2" else f"{2**62}\n")  # no limit of its own
  (parent / limit).write_text(f"{8 * 2**30}\n")
  (parent / usage).write_text(f"{3 * 2**30}\n")
  (parent / "memory.stat").write_text(f"anon 1\n{reclaimable} {2**30}\n")
  membership = tmp_path / "cgroup"
  membership.write_text("4:memory:/jobs/job7\n" if version == "v1" else "0::/jobs/job7\n")
  limits = memory_limit.host_limits(membership, tmp_path)
  cgroup = [x for x in limits if "cgroup" in x.what]
  assert len(cgroup) == 1 and cgroup[0].bytes == 6 * 2**30 and str(parent / limit) in cgroup[0].what


def test_out_of_memory_errors_name_the_bytes_asked():
  cases = {
    "RESOURCE_EXHAUSTED: Out of memory allocating 19626823392 bytes.": 19626823392,  # XLA:CPU
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.": 2**30,  # XLA:GPU
    "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 12.00G. That was not possible.": 12 * 2**30,  # TPU
    "Ran out of memory in memory space hbm. Used 120.50G of 95.74G hbm.": int(120.5 * 2**30),  # TPU compile
  }
  for text, asked in cases.items():
    assert memory_limit.asked_bytes(RuntimeError(text)) == asked, text
  error = memory_limit.out_of_memory(RuntimeError(next(iter(cases))), "in train step 3", "lower x")
  assert error is not None and error.exit_code == 1
  assert str(error).startswith("out of memory in train step 3: it asked for 18.28 GiB (19626823392 bytes), and ") and str(error).endswith("; lower x")
  assert memory_limit.out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes differ"), "x", "y") is None
  with pytest.raises(memory_limit.OutOfMemory, match="out of memory in the eval: an allocation failed"):
    with memory_limit.one_line("in the eval", "lower y"):
      raise MemoryError()


# --- signals ----------------------------------------------------------------------------------------------------------


def test_signal_before_the_first_step_exits_cleanly_writing_nothing(tmp_path, shared_setup, monkeypatch, capsys):
  real = preflight.run_checks

  def checks_then_sigint(*a, **k):
    checked = real(*a, **k)
    os.kill(os.getpid(), signal.SIGINT)
    return checked

  monkeypatch.setattr(preflight, "run_checks", checks_then_sigint)
  result = train(_cfg(tmp_path), setup=shared_setup)
  assert result.stop_reason == "sigint" and result.steps_done == 0
  assert "received SIGINT before the first step" in capsys.readouterr().out
  assert os.listdir(tmp_path) == []
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_sigterm_during_eval_saves_the_last_step(tmp_path, shared_setup, monkeypatch, capsys):
  real = loop_lib.create_data_iterator

  def eval_preempted(config, mesh, split):
    it = real(config, mesh, split)
    if split != "eval":
      return it

    def batches():
      os.kill(os.getpid(), signal.SIGTERM)
      yield from it

    return batches()

  monkeypatch.setattr(loop_lib, "create_data_iterator", eval_preempted)
  result = train(_cfg(tmp_path, eval_interval=1, eval_steps=2, checkpoint_period=100), setup=shared_setup)
  assert result.stop_reason == "sigterm" and result.steps_done == 1 and result.eval_losses == {}
  assert "received SIGTERM: saved a checkpoint after step 0" in capsys.readouterr().out
  assert os.path.isdir(tmp_path / "r" / "checkpoints" / "1" / "items")


# --- quieter losses -----------------------------------------------------------------------------------------------------


def test_metrics_are_flushed_at_every_checkpoint(tmp_path, shared_setup):
  path = tmp_path / "metrics.jsonl"
  seen = {}

  def on_step(step):
    seen[step] = len(path.read_text().splitlines()) if path.exists() else 0

  train(_cfg(tmp_path, metrics_file=str(path), log_period=1000, steps=4), setup=shared_setup, on_step=on_step)
  assert seen[2] >= 2  # step 2 is logged after the save of 2 steps flushed steps 0 and 1
  assert len(path.read_text().splitlines()) == 4  # and the rest on exit


@pytest.mark.parametrize("damage", ["data_state_missing", "data_state_garbage", "data_state_foreign", "schedule_missing", "schedule_garbage"])
def test_a_step_without_its_data_state_or_schedule_record_is_unusable(two_checkpoints, shared_setup, tmp_path, damage):
  """The data position and the schedule record belong to their step: damaged or missing, the step falls back like damaged arrays."""
  src, _ = two_checkpoints
  _copy(src, tmp_path)
  ckpts = tmp_path / "r" / "checkpoints"
  data_file = ckpts / "data_iterator" / "4" / "process_0.json"
  if damage == "data_state_missing":
    data_file.unlink()
  elif damage == "data_state_garbage":
    data_file.write_text("{not json")
  elif damage == "data_state_foreign":
    data_file.write_text('{"position": 3}')
  elif damage == "schedule_missing":
    shutil.rmtree(ckpts / "4" / checkpointing.SCHEDULE)
  else:
    (ckpts / "4" / checkpointing.SCHEDULE / "metadata").write_text("[1, 2")
  config = _cfg(tmp_path)
  data_iter = loop_lib.create_data_iterator(config, shared_setup.mesh, "train")
  said = []
  restored = _restore(config, shared_setup, said, data_iter)
  assert int(restored.state["step"]) == 2 and restored.schedule_steps == 4
  assert data_iter.get_state() == {"step": 2}  # the data position of step 2, not a reset
  assert len(said) == 1 and f"checkpoint {ckpts / '4'} is unusable (its " in said[0]
  assert ("data-iterator state" if damage.startswith("data") else "schedule record") in said[0]


def test_resume_with_another_schedule_warns_how_to_pin_it(two_checkpoints, shared_setup, tmp_path):
  src, _ = two_checkpoints
  _copy(src, tmp_path)
  config = _cfg(tmp_path, steps=6, learning_rate_schedule_steps=-1)
  restored = _restore(config, shared_setup, [], loop_lib.create_data_iterator(config, shared_setup.mesh, "train"))
  said = checkpointing.schedule_warning(config, restored.schedule_steps, 4, "C")
  assert "now spans 6 steps" in said and "at step 4 in C was trained with 4" in said and "pass learning_rate_schedule_steps=4" in said
  assert checkpointing.schedule_warning(_cfg(tmp_path, steps=8, learning_rate_schedule_steps=4), 4, 4, "C") is None  # pinned: no warning


def test_library_warnings_are_muted():
  """absl warnings (Orbax), 'Event loop is closed' after a failed checkpoint read and the resource tracker's
  leaked-shared_memory warning (grain workers) stay off stderr."""
  code = (
    "import sys\n"
    "from maxtext.errors import quiet_libraries\n"
    "quiet_libraries() if sys.argv[1] == 'quiet' else None\n"
    "from absl import logging\n"
    "logging.warning('an absl warning')\n"
    "from multiprocessing import shared_memory\n"
    "leaked = shared_memory.SharedMemory(create=True, size=64)\n"
    "class Callback:\n"
    "  def __del__(self):\n"
    "    raise RuntimeError('Event loop is closed')\n"
    "Callback()\n"
  )
  env = dict(os.environ, PYTHONPATH=str(os.path.dirname(os.path.dirname(__file__))))
  loud = subprocess.run([sys.executable, "-c", code, "loud"], capture_output=True, text=True, env=env, timeout=60)
  quiet = subprocess.run([sys.executable, "-c", code, "quiet"], capture_output=True, text=True, env=env, timeout=60)
  assert "an absl warning" in loud.stderr and "leaked shared_memory" in loud.stderr and "Event loop is closed" in loud.stderr
  assert quiet.returncode == 0 and quiet.stderr == ""


def test_an_existing_metrics_file_is_appended_to_not_refused(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 0}\n')
  outputs.check_writable(str(path), 0, "metrics_file", is_file=True)
  with pytest.raises(outputs.OutputError, match="is a directory"):
    outputs.check_writable(str(tmp_path), 0, "metrics_file", is_file=True)


def test_a_second_ctrl_c_stops_at_once():
  before = signal.getsignal(signal.SIGTERM)
  with Preemption() as preemption:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM still waits for the save
    assert preemption.signal_name == "SIGTERM"
  with Preemption() as preemption:
    os.kill(os.getpid(), signal.SIGINT)
    assert preemption.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGTERM) is before
