"""The edges of a run, each as the user meets it in a process of its own (tests/cli_processes.py forks them from one
parent that imported everything once; they share JAX's persistent compilation cache, so each is cheap):

- SIGTERM at 20 moments across the end of a run (the last step and its save, the eval, the summary, the plot, the
  closing of files and the interpreter's shutdown): every process exits 0 with its last step saved; so does SIGINT
  after the end; a second Ctrl-C stops at once, in one line;
- a run under an address-space limit (RLIMIT_AS, as `prlimit --as` or `ulimit -v` sets) is refused before it writes
  anything, naming the limit; an out-of-memory error that still happens at run time is one line and exit 1, and leaves
  no checkpoint directory;
- a run that uses up its data (num_epoch=1, steps=500) saves its last step, says so and exits 0; a rerun that starts
  at or past `steps` says so in one line and leaves every file byte-identical;
- a missing or damaged data-iterator file makes its step unusable: the run falls back to the previous step, saying so
  (never a silent reset of the data position). (The other bad inputs: tests/test_bad_inputs.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_processes import hashes
from tests.test_data_common import sp_model
from tests.test_train_helpers import TINY_MODEL
from tests.xla_env import xla_flags

REPO = Path(__file__).resolve().parents[1]
# Every job trains the same model on batches of the same shape with the same schedule: one compiled step, cached.
COMMON = dict(TINY_MODEL, vocab_size=320, learning_rate_schedule_steps=20, device_peak_tflops=1, log_period=100, run_name="r")
SWEEP = dict(COMMON, steps=3, checkpoint_period=100, eval_interval=3, eval_steps=1, async_checkpointing="true", enable_tensorboard="false")
# (line the delay counts from, delays in seconds, with TensorBoard and the plot): the last step and its (asynchronous)
# save, the eval, the summary, the plot (written between these two lines), the closing of files and the shutdown
SWEEP_POINTS = [
  ("completed step: 2,", (0.0, 0.02, 0.05, 0.1), False),
  ("eval after step 2", (0.0, 0.02), False),
  ("run r completed", (0.0, 0.01, 0.03), False),
  ("checkpoint: ", (0.0, 0.02, 0.05, 0.1), True),
  ("resume: ", (0.0, 0.03, 0.1, 0.4), True),
  ("checkpoint: ", (0.0, 0.01, 0.05), False),
]
BIG = dict(base_emb_dim=128, base_num_query_heads=4, base_num_kv_heads=2, base_mlp_dim=256, base_num_decoder_layers=2, head_dim=32)
OUT_OF_MEMORY = dict(
  BIG, per_device_batch_size=2, vocab_size=512, dataset_type="synthetic", max_target_length=32768, steps=2, device_peak_tflops=1, run_name="r"
)
ADDRESS_SPACE_EXTRA = 3 * 2**30  # what the limit leaves above the address space mapped when the process starts
DATA_ROWS = 12


def _argv(keys: dict) -> list[str]:
  return [str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


def _job(tmp: Path, name: str, keys: dict, phase: int, **extra) -> dict:
  out = tmp / name
  return {
    "argv": _argv({**keys, "base_output_directory": str(out)}),
    "stdout": str(tmp / f"{name}.out"),
    "stderr": str(tmp / f"{name}.err"),
    "cwd": str(tmp),
    "phase": phase,
    **extra,
  }


def _jobs(tmp: Path) -> dict[str, dict]:
  rows = tmp / "rows.jsonl"
  rows.write_text("".join(json.dumps({"text": f"document {i} about the model and the data"}) + "\n" for i in range(DATA_ROWS)))
  data = dict(COMMON, dataset_type="grain", grain_file_type="jsonl", grain_train_files=str(rows), tokenizer_path=sp_model(), packing="false")
  data.update(num_epoch=1, steps=500, checkpoint_period=100, grain_worker_count=0, enable_tensorboard="false")
  base = dict(COMMON, steps=2, checkpoint_period=1, enable_tensorboard="false", async_checkpointing="false")
  # phase 0 compiles each step once (into the shared cache); phase 1 uses it; phase 2 needs phase 1's outputs
  jobs = {
    "sweep_reference": _job(tmp, "sweep_reference", dict(SWEEP, enable_tensorboard="true"), 0),
    "memory_refused": _job(tmp, "memory_refused", OUT_OF_MEMORY, 0, address_space_extra=ADDRESS_SPACE_EXTRA),
    "data_bounded": _job(tmp, "data_bounded", data, 1),
    "resume_base": _job(tmp, "resume_base", base, 1),
    "out_of_memory_at_run_time": _job(tmp, "oom", OUT_OF_MEMORY, 1, address_space_extra=ADDRESS_SPACE_EXTRA, no_memory_check=True),
    "ctrl_c_twice": _job(tmp, "ctrl_c_twice", dict(SWEEP, steps=1000), 1, signals=[["completed step: 5,", 0.0, "SIGINT"], [None, 0.02, "SIGINT"]]),
    "sigint_after_the_end": _job(tmp, "sigint_after_the_end", SWEEP, 1, signals=[["resume: ", 0.0, "SIGINT"]]),
  }
  jobs["nothing_to_train"] = _job(tmp, "data_bounded", dict(data, steps=5), 2, prepare=[["snapshot", str(tmp / "data_bounded"), str(tmp / "before.json")]])
  jobs["nothing_to_train"].update(stdout=str(tmp / "nothing_to_train.out"), stderr=str(tmp / "nothing_to_train.err"))
  data_file = "r/checkpoints/data_iterator/2/process_0.json"
  for damage, action in (("missing", ["delete"]), ("garbage", ["write", "\x00garbage{"])):
    name = f"data_state_{damage}"
    act = [action[0], str(tmp / name / data_file), *action[1:]]
    jobs[name] = _job(tmp, name, dict(base, steps=3), 2, prepare=[["copy", str(tmp / "resume_base"), str(tmp / name)], act])
  for point, delays, tensorboard in SWEEP_POINTS:
    for delay in delays:
      name = f"sigterm_{len([k for k in jobs if k.startswith('sigterm')]):02d}"
      jobs[name] = _job(tmp, name, dict(SWEEP, enable_tensorboard=str(tensorboard).lower()), 1, signals=[[point, delay, "SIGTERM"]])
  return jobs


@pytest.fixture(scope="module")
def ends(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("ends")
  jobs = _jobs(tmp)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), PYTHONPATH=str(REPO))
  env.update(JAX_COMPILATION_CACHE_DIR=str(tmp / "jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  env.pop("PYTHONWARNINGS", None)
  proc = subprocess.run(
    [sys.executable, "-m", "tests.cli_processes"], input=json.dumps(list(jobs.values())), capture_output=True, text=True, env=env, cwd=REPO, timeout=900
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return tmp, dict(zip(jobs, json.loads(proc.stdout), strict=True))


def _ok(result: dict) -> str:
  return f"exit {result['code']}\n--- stdout\n{result['stdout'][-2000:]}\n--- stderr\n{result['stderr'][-3000:]}"


def _finished_step(run: Path, step: int) -> bool:
  ckpts = run / "r" / "checkpoints"
  return (ckpts / str(step) / "_CHECKPOINT_METADATA").is_file() and not any("tmp" in p.name for p in ckpts.iterdir())


def test_sigterm_at_20_moments_of_the_end_exits_0_with_the_last_step_saved(ends):
  tmp, results = ends
  sweep = {k: v for k, v in results.items() if k.startswith("sigterm")}
  assert len(sweep) == 20
  assert results["sweep_reference"]["code"] == 0, _ok(results["sweep_reference"])
  for name, result in sweep.items():
    assert result["code"] == 0 and "Traceback" not in result["stderr"], f"{name}: {_ok(result)}"
    assert _finished_step(tmp / name, 3), f"{name}: {_ok(result)}"
  delivered = sum(result["delivered"][0] for result in sweep.values())
  assert delivered >= 15, f"only {delivered} of 20 signals reached a running process"  # else the sweep proves little


def test_sigint_after_the_end_exits_0_and_a_second_ctrl_c_stops_at_once_in_one_line(ends):
  tmp, results = ends
  after = results["sigint_after_the_end"]
  assert after["code"] == 0 and after["stderr"] == "", _ok(after)
  twice = results["ctrl_c_twice"]
  assert twice["delivered"] == [True, True] and twice["code"] == 130, _ok(twice)
  lines = twice["stderr"].strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: interrupted by Ctrl-C; stopped at once"), _ok(twice)


def test_an_address_space_limit_is_seen_before_anything_is_written(ends):
  tmp, results = ends
  result = results["memory_refused"]
  lines = result["stderr"].strip().splitlines()
  assert result["code"] == 2 and len(lines) == 1, _ok(result)
  assert "GiB per device" in lines[0] and "RLIMIT_AS (ulimit -v)" in lines[0] and "lower per_device_batch_size (2.0)" in lines[0]
  assert not (tmp / "memory_refused").exists()


def test_out_of_memory_at_run_time_is_one_line_exit_1_and_no_checkpoint_directory(ends):
  tmp, results = ends
  result = results["out_of_memory_at_run_time"]
  lines = result["stderr"].strip().splitlines()
  assert result["code"] == 1 and len(lines) == 1, _ok(result)
  assert lines[0].startswith("error: out of memory in train step 0: it asked for ") and "bytes)" in lines[0]
  assert "RLIMIT_AS (ulimit -v)" in lines[0] and "max_target_length (32768)" in lines[0]
  assert not (tmp / "oom").exists()  # no checkpoint directory, and the run directory the lock made is gone


def test_a_run_that_uses_up_its_data_saves_its_last_step_and_exits_0(ends):
  tmp, results = ends
  result = results["data_bounded"]
  assert result["code"] == 0, _ok(result)
  assert f"data used up after 1 epoch at step {DATA_ROWS}; steps 0 -> {DATA_ROWS}" in result["stdout"]
  assert _finished_step(tmp / "data_bounded", DATA_ROWS)


def test_a_rerun_at_or_past_steps_says_so_and_changes_nothing(ends):
  tmp, results = ends
  result = results["nothing_to_train"]
  assert result["code"] == 0 and result["stderr"] == "", _ok(result)
  assert result["stdout"].splitlines() == [
    f"checkpoint at step {DATA_ROWS} in {tmp / 'data_bounded' / 'r' / 'checkpoints'}/ already reaches steps=5; nothing to train (raise steps to train further)"
  ]
  assert hashes(tmp / "data_bounded") == json.loads((tmp / "before.json").read_text())


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_a_missing_or_damaged_data_iterator_file_makes_its_step_unusable(ends, damage):
  tmp, results = ends
  result = results[f"data_state_{damage}"]
  assert result["code"] == 0 and "Traceback" not in result["stderr"], _ok(result)
  step_dir = tmp / f"data_state_{damage}" / "r" / "checkpoints" / "2"
  said = [line for line in result["stdout"].splitlines() if "is unusable" in line]
  assert len(said) == 1 and said[0].startswith(f"checkpoint {step_dir} is unusable (its data-iterator state"), _ok(result)
  assert ("is missing" if damage == "missing" else "is damaged") in said[0]
  assert "restored checkpoint at step 1 from" in result["stdout"]  # the previous step, with its own data position
  assert _finished_step(tmp / f"data_state_{damage}", 3)
