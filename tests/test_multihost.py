"""Multi-process training on CPU: 2 processes x 4 devices (jax.distributed, explicit coordinator on 127.0.0.1)
match 1 process x 8 devices, and checkpoints move between the two layouts in both directions."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_env import xla_flags

TIMEOUT_S = 240
MODEL = [
  "base_emb_dim=32",
  "base_mlp_dim=64",
  "base_num_query_heads=2",
  "base_num_kv_heads=2",
  "head_dim=16",
  "base_num_decoder_layers=1",
  "vocab_size=512",
  "per_device_batch_size=1",
  "max_target_length=16",
  "dataset_type=synthetic",
  "learning_rate=1e-2",
  "learning_rate_schedule_steps=6",  # runs of 3, 4 and 6 steps compile the same program
  "checkpoint_period=4",
  "async_checkpointing=false",
  "log_period=1",
  "device_peak_tflops=1",  # no throughput measurement for MFU
]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def train_args(out: Path, run_name: str, steps: int, data: tuple[str, ...]) -> list[str]:
  overrides = dict(a.split("=", 1) for a in [*MODEL, *data])  # data settings replace the model's defaults
  args = ["configs/base.yml", f"run_name={run_name}", f"base_output_directory={out}", f"steps={steps}", f"metrics_file={out / run_name / 'metrics.jsonl'}"]
  return args + [f"{k}={v}" for k, v in overrides.items()]


def start(out: Path, run_name: str, processes: int, steps: int, data: tuple[str, ...] = ()) -> list[tuple[subprocess.Popen, Path]]:
  """`processes` processes of python -m maxtext.train sharing 8 CPU devices, joined through a coordinator on 127.0.0.1.
  They share a persistent compilation cache, so a program compiled once (per process layout) loads in later runs."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=xla_flags(8 // processes),
    JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )
  args = [sys.executable, "-m", "maxtext.train", *train_args(out, run_name, steps, data)]
  if processes > 1:
    args += [f"jax_coordinator_address=127.0.0.1:{free_port()}", f"jax_num_processes={processes}", "jax_distributed_initialization_timeout=60"]
  procs = []
  for i in range(processes):
    log = out / f"{run_name}.{steps}.process{i}.log"
    extra = [f"jax_process_id={i}"] if processes > 1 else []
    with open(log, "w") as f:
      procs.append((subprocess.Popen([*args, *extra], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[1]), log))
  return procs


def run_all(out: Path, runs: dict[str, tuple[str, int, int, tuple[str, ...]]]) -> dict[str, list[str]]:
  """runs: label -> (run_name, processes, steps, data args), run at the same time; all are killed if one hangs.
  Returns each run's per-process output."""
  groups = {label: start(out, name, processes, steps, data) for label, (name, processes, steps, data) in runs.items()}
  procs = [p for group in groups.values() for p, _ in group]
  try:
    for p in procs:
      p.wait(timeout=TIMEOUT_S)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  logs = {name: [log.read_text() for _, log in group] for name, group in groups.items()}
  for name, group in groups.items():
    for (p, _), text in zip(group, logs[name]):
      assert p.returncode == 0, f"{name}: {text[-3000:]}"
  return logs


def losses(out: Path, run_name: str) -> dict[int, float]:
  rows = [json.loads(line) for line in (out / run_name / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in rows]
  assert len(steps) == len(set(steps)), "a step was written twice (only process 0 may write metrics)"
  return {r["step"]: r["loss"] for r in rows}


def grain_data(out: Path) -> tuple[str, ...]:
  """A jsonl corpus and a tiny sentencepiece model for dataset_type=grain."""
  from tests.test_data_common import doc_text, sp_model, write_jsonl

  files = [write_jsonl(out / f"part{i}.jsonl", [{"text": doc_text(i * 100 + j)} for j in range(100)]) for i in range(2)]
  assert files
  return (
    "dataset_type=grain",
    "grain_file_type=jsonl",
    f"grain_train_files={out / 'part*.jsonl'}",
    f"tokenizer_path={sp_model()}",
    "grain_worker_count=0",
    "enable_data_shuffling=false",
    "enable_checkpointing=false",
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Phase 1: one process and two processes train 4 steps on synthetic data, each saving a checkpoint at step 4.
  Phase 2: each checkpoint continues to step 6 with the other process count, and both layouts train 3 steps on
  grain data. Phase 1 compiles each program once per process layout; phase 2 loads them from the cache."""
  out = tmp_path_factory.mktemp("multihost")
  grain = grain_data(out)
  logs = run_all(out, {"one": ("one", 1, 4, ()), "two": ("two", 2, 4, ())})
  first = {name: losses(out, name) for name in ("one", "two")}
  logs |= run_all(
    out,
    {
      "one+": ("one", 2, 6, ()),
      "two+": ("two", 1, 6, ()),
      "grain_one": ("grain_one", 1, 3, grain),
      "grain_two": ("grain_two", 2, 3, grain),
    },
  )
  later = {name: losses(out, name) for name in ("one", "two", "grain_one", "grain_two")}
  return out, first, later, logs


def test_two_processes_match_one_process(runs):
  _, first, _, _ = runs
  assert sorted(first["one"]) == sorted(first["two"]) == [0, 1, 2, 3]
  for step in range(4):
    assert first["two"][step] == pytest.approx(first["one"][step], rel=1e-5, abs=1e-6)
  assert len(set(first["one"].values())) == 4  # every step is a different batch


def test_two_processes_match_one_process_on_grain_data(runs):
  _, _, later, _ = runs
  first = later
  assert sorted(first["grain_one"]) == sorted(first["grain_two"]) == [0, 1, 2]
  for step in range(3):
    assert first["grain_two"][step] == pytest.approx(first["grain_one"][step], rel=1e-5, abs=1e-6)
  assert len(set(first["grain_one"].values())) == 3  # different batches


def test_checkpoints_restore_across_process_counts(runs):
  _, _, second, logs = runs
  assert "restored checkpoint at step 4" in logs["one+"][0]  # written by 1 process, read by 2
  assert "restored checkpoint at step 4" in logs["two+"][0]  # written by 2 processes, read by 1
  for name in ("one", "two"):
    assert sorted(second[name]) == [0, 1, 2, 3, 4, 5]
  # both continuations start from equal states and see the same data
  for step in (4, 5):
    assert second["one"][step] == pytest.approx(second["two"][step], rel=1e-5, abs=1e-6)


def test_only_process_zero_writes_logs_and_tensorboard(runs):
  out, _, _, logs = runs
  assert "completed step: 0" in logs["two"][0]
  assert "completed step" not in logs["two"][1]
  events = list((out / "two" / "tensorboard").rglob("events.out.tfevents*"))
  assert len(events) == 2  # one per run segment (phase 1: 2 processes, phase 2: 1 process), each from process 0 only
