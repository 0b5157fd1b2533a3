"""Goodput (enable_goodput_recording, monitor_goodput): the parts add up to the wall time, and a restart's
recomputed steps count as lost."""

import json
import time

import jax
import jax.numpy as jnp
import pytest

from maxtext.train import goodput
from maxtext.train import setup as setup_lib
from maxtext.train.loop import train
from tests.test_train_helpers import mesh_for, tiny_config


class Crash(RuntimeError):
  """Stands for a preemption that kills the run: nothing is saved after it."""


def _cfg(tmp, steps):
  return tiny_config(
    num_devices=1,
    base_output_directory=str(tmp),
    run_name="g",
    steps=steps,
    learning_rate_schedule_steps=10,
    checkpoint_period=4,
    eval_interval=5,
    eval_steps=1,
    enable_goodput_recording=True,
    monitor_goodput=True,
    log_period=2,
  )


@pytest.fixture(scope="module")
def attempts(tmp_path_factory):
  """Attempt 1 crashes after logging step 6 (checkpoint at 4); attempt 2 resumes at 4 and runs to 10."""
  tmp = tmp_path_factory.mktemp("goodput")

  def crash_at_6(step):
    if step == 6:
      raise Crash

  with pytest.raises(Crash):
    config = _cfg(tmp, 10)
    setup = setup_lib.build(config, mesh_for(config))  # one compiled step for both attempts
    train(config, setup=setup, on_step=crash_at_6)
  began = time.perf_counter()
  result = train(config, setup=setup)
  wall = time.perf_counter() - began
  report = json.loads((tmp / "g" / goodput.REPORT_FILE).read_text())
  return result, wall, report, tmp


def test_parts_add_up_to_the_wall_time(attempts):
  _, wall, report, _ = attempts
  (attempt,) = report["attempts"]  # the crashed attempt never finished, so it wrote no breakdown
  parts = attempt["seconds"]
  assert set(parts) == set(goodput.PARTS)
  assert abs(sum(parts.values()) - wall) <= 0.02 * wall, (parts, wall)
  assert abs(attempt["wall_seconds"] - wall) <= 0.02 * wall
  for part in ("productive_steps", "lost_steps", "checkpoint_restore", "checkpoint_save", "evaluation", "data_waiting"):
    assert parts[part] > 0, part
  assert 0 < report["goodput"] < 1


def test_recomputed_steps_after_a_restart_are_lost(attempts):
  result, _, report, tmp = attempts
  assert result.steps_done == 10
  steps = report["attempts"][-1]["steps"]
  assert steps == {"start": 4, "productive": 3, "lost": 3, "furthest_before": 7}  # steps 4, 5, 6 ran twice
  assert goodput.read_furthest(str(tmp / "g")) == 10


def test_summary_and_monitor_lines(tmp_path):
  g = goodput.Goodput(recording=False, monitor=True, log_period=1)
  lines = []
  with g.phase("initialization"):
    jax.jit(lambda x: x * 3 + 1).lower(jnp.ones(7)).compile()  # carved out of initialization by JAX's compile events
  g.start(str(tmp_path), 0, lines.append)
  g.step_logged(0)
  g.finish()
  assert lines[0].startswith("goodput after step 0: goodput ") and lines[-1].startswith("goodput ")
  assert g.report()["seconds"]["compilation"] > 0
  assert not (tmp_path / goodput.REPORT_FILE).exists()  # monitor_goodput alone logs; enable_goodput_recording writes the file


def test_progress_file_goes_through_epath_without_holding_up_the_steps(tmp_path, monkeypatch):
  """goodput_progress.json is written through etils epath (gs:// capable, like the checkpoints) on a background thread:
  a write that takes 2 s does not slow 20 logged steps down; the newest furthest step lands by the end of the steps,
  and a failed write is raised in the loop's thread."""
  from etils import epath

  path_class = type(epath.Path(tmp_path))
  original = path_class.write_text
  written = []

  def slow_write(self, text, *args, **kwargs):
    if self.name == goodput.PROGRESS_FILE + ".tmp":
      time.sleep(2)
      written.append(json.loads(text)["furthest_step"])
    return original(self, text, *args, **kwargs)

  monkeypatch.setattr(path_class, "write_text", slow_write)
  g = goodput.Goodput(recording=True, monitor=False, log_period=100)
  g.start(str(tmp_path), 0, print)
  began = time.perf_counter()
  for step in range(20):
    g.step_logged(step)
  assert time.perf_counter() - began < 1.0
  g.steps_ended()  # waits for the newest step to be written
  assert goodput.read_furthest(str(tmp_path)) == 20
  assert written[-1] == 20 and len(written) <= 3, written  # steps noted during a write are merged into the next one

  def failing_write(self, text, *args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(path_class, "write_text", failing_write)
  g.step_logged(20)
  with pytest.raises(OSError, match="No space left"):
    g.steps_ended()


def test_monitor_goodput_adds_no_host_sync(tmp_path, monkeypatch):
  """monitor_goodput's running figure comes from host clocks only: logging it every step waits on no device value
  (no block_until_ready, no device_get, no implicit transfer)."""

  def sync(*args, **kwargs):
    raise AssertionError("goodput waited on the device")

  monkeypatch.setattr(jax, "block_until_ready", sync)
  monkeypatch.setattr(jax, "device_get", sync)
  g = goodput.Goodput(recording=True, monitor=True, log_period=1)
  lines = []
  with jax.transfer_guard("disallow"):
    g.start(str(tmp_path), 0, lines.append)
    for step in range(4):
      g.step_logged(step)
    g.steps_ended()
  assert [line.split(":")[0] for line in lines] == [f"goodput after step {s}" for s in range(4)]
