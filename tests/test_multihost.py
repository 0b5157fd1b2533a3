"""Multi-process training on CPU: 2 processes x 4 devices (jax.distributed, explicit coordinator on 127.0.0.1)
match 1 process x 8 devices, and checkpoints move between the two layouts in both directions."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 240
MODEL = [
  "base_emb_dim=32",
  "base_mlp_dim=64",
  "base_num_query_heads=2",
  "base_num_kv_heads=2",
  "head_dim=16",
  "base_num_decoder_layers=1",
  "vocab_size=128",
  "per_device_batch_size=1",
  "max_target_length=16",
  "dataset_type=synthetic",
  "learning_rate=1e-2",
  "checkpoint_period=4",
  "async_checkpointing=false",
  "log_period=1",
]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(out: Path, run_name: str, processes: int, steps: int, data: tuple[str, ...] = ()) -> list[tuple[subprocess.Popen, Path]]:
  """Start `processes` processes of python -m maxtext.train sharing 8 CPU devices; stdout of each goes to a file."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}")
  overrides = dict(a.split("=", 1) for a in [*MODEL, *data])  # data settings replace the model's defaults
  args = [sys.executable, "-m", "maxtext.train", "configs/base.yml", f"run_name={run_name}", f"base_output_directory={out}", f"steps={steps}"]
  args += [f"{k}={v}" for k, v in overrides.items()]
  args.append(f"metrics_file={out / run_name / 'metrics.jsonl'}")
  if processes > 1:
    args += [f"jax_coordinator_address=127.0.0.1:{free_port()}", f"jax_num_processes={processes}", "jax_distributed_initialization_timeout=60"]
  procs = []
  for i in range(processes):
    log = out / f"{run_name}.{steps}.process{i}.log"
    extra = [f"jax_process_id={i}"] if processes > 1 else []
    with open(log, "w") as f:
      procs.append((subprocess.Popen([*args, *extra], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[1]), log))
  return procs


def finish(groups: dict[str, list[tuple[subprocess.Popen, Path]]]) -> dict[str, list[str]]:
  """Wait for every process of every run; kill them all if one hangs. Returns each run's per-process output."""
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
    "vocab_size=512",
    "grain_worker_count=0",
    "enable_data_shuffling=false",
    "enable_checkpointing=false",
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Phase 1: one process and two processes train 4 steps on synthetic data, each saving a checkpoint at step 4,
  and 3 steps on grain data. Phase 2: each synthetic checkpoint continues to step 6 with the other process count."""
  out = tmp_path_factory.mktemp("multihost")
  grain = grain_data(out)
  logs = {}
  phase1 = {"one": start(out, "one", 1, 4), "two": start(out, "two", 2, 4), "grain_one": start(out, "grain_one", 1, 3, grain)}
  phase1["grain_two"] = start(out, "grain_two", 2, 3, grain)
  logs.update(finish(phase1))
  first = {name: losses(out, name) for name in phase1}
  phase2 = {"one": start(out, "one", 2, 6), "two": start(out, "two", 1, 6)}
  logs.update({f"{name}+": text for name, text in finish(phase2).items()})
  return out, first, {name: losses(out, name) for name in phase2}, logs


def test_two_processes_match_one_process(runs):
  _, first, _, _ = runs
  assert sorted(first["one"]) == sorted(first["two"]) == [0, 1, 2, 3]
  for step in range(4):
    assert first["two"][step] == pytest.approx(first["one"][step], rel=1e-5, abs=1e-6)
  assert first["one"][3] < first["one"][0]  # it trains


def test_two_processes_match_one_process_on_grain_data(runs):
  _, first, _, _ = runs
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
