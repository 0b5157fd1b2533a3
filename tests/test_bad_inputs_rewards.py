"""GRPO reward functions that misbehave, run as the user would (a subprocess of `python -m maxtext.train` on the tiny
model, whose vocab_size=512 pads the 320-token sentencepiece model: every rollout also proves that no padding id
is sampled). A hung reward is stopped by grpo_reward_timeout_s with one line naming it, or by SIGTERM (the last whole
step is saved, exit 0); a NaN weight is refused before anything is written. No run leaves its run.lock behind.
The other reward failures are one-line errors of the worker itself (tests/test_sampling_padded_vocab.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_bad_inputs import GRPO, _env, _make_inputs, _run_case, _train
from tests.test_data_common import sp_model

RUN_TIMEOUT_SECONDS = 300  # a GRPO run of the tiny model takes about 30 s of CPU: reaching it means the run hung
# Reward functions written into each case's working directory (the trainer imports `hooks` from there).
HOOKS = '''
import os
import time


def ok(prompts, completions, **_):
  return [float(len(c)) for c in completions]


def hangs_in_step_1(prompts, completions, **_):
  """Scores step 0; in step 1 leaves a marker file and never returns."""
  if os.path.exists("step0_scored"):
    open("in_reward", "w").close()
    while True:
      time.sleep(1)
  open("step0_scored", "w").close()
  return [0.0] * len(completions)
'''
GRPO_HOOKS = (*[k for k in GRPO if not k.startswith("grpo_reward_functions=")], "steps=2", "grpo_beta=0", "device_peak_tflops=1")
TIMEOUT = ("grpo_reward_functions=[hooks:ok,hooks:hangs_in_step_1]", "grpo_reward_timeout_s=3")
HANGS = ("grpo_reward_functions=[hooks:hangs_in_step_1]",)  # under the default time limit (10 minutes)


def _workdir(root: Path) -> Path:
  work = root / "work"
  work.mkdir()
  _make_inputs(work)
  (work / "hooks.py").write_text(HOOKS)
  return work


def _args(argv: list[str], work: Path) -> list[str]:
  return [a.replace("{tmp}", str(work)).replace("{sp}", sp_model()) for a in argv]


def _no_lock_left(work: Path) -> bool:
  return not list((work / "out").rglob("run.lock"))


def _timed_out(work: Path) -> subprocess.CompletedProcess:
  return subprocess.run(_args(_train(*GRPO_HOOKS, *TIMEOUT), work), capture_output=True, text=True, cwd=work, env=_env(), timeout=RUN_TIMEOUT_SECONDS)


def _terminated(work: Path) -> tuple[int, str, str]:
  """Step 0 trains; step 1's reward hangs; SIGTERM as soon as it does -> (exit code, stdout, stderr)."""
  proc = subprocess.Popen(_args(_train(*GRPO_HOOKS, *HANGS), work), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work, env=_env())
  try:
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while not (work / "in_reward").exists() and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)  # the reward would hang for 10 minutes
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The two GRPO runs, side by side (each compiles the tiny model's train step and rollout)."""
  works = [_workdir(tmp_path_factory.mktemp(name)) for name in ("timeout", "sigterm")]
  sp_model()
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    timed_out, terminated = pool.submit(_timed_out, works[0]), pool.submit(_terminated, works[1])
    return (timed_out.result(), works[0]), (terminated.result(), works[1])


def test_hung_reward_is_stopped_by_its_time_limit_with_one_line(runs):
  proc, work = runs[0]
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: ") and "'hooks:hangs_in_step_1' did not return within grpo_reward_timeout_s=3" in lines[0], lines
  assert "Traceback" not in proc.stdout + proc.stderr
  assert "completed step: 0" in proc.stdout  # the padded vocabulary's rollout decoded and trained
  assert _no_lock_left(work)


def test_sigterm_while_a_reward_hangs_saves_the_last_step_and_exits_0(runs):
  (code, out, err), work = runs[1]
  assert (work / "in_reward").exists(), err[-3000:]
  assert code == 0, err[-3000:]
  assert "received SIGTERM: saved a checkpoint after step 0" in out, out[-3000:]
  assert "Traceback" not in out + err
  checkpoints = work / "out" / "r" / "checkpoints"
  assert (checkpoints / "1").is_dir() and not (checkpoints / "2").exists()
  assert json.loads((checkpoints / "data_iterator" / "1" / "process_0.json").read_text())["batches_read"] == 1  # step 1's prompts put back
  assert _no_lock_left(work)


def test_nan_reward_weight_is_refused_before_anything_is_written(tmp_path):
  work = _workdir(tmp_path)
  proc, before, after = _run_case(_train(*GRPO_HOOKS, "grpo_reward_functions=[hooks:ok]", "grpo_reward_weights=[nan]"), work, tmp_path, sp_model())
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1 and "'grpo_reward_weights'" in lines[0] and "finite" in lines[0], proc.stderr[-3000:]
  assert after == before
