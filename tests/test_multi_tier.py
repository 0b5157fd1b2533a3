"""The local checkpoint tier on 2 processes x 4 CPU devices: kill -9 both at step 17 (local period 5, persistent
period 20) resumes from the local step 15 with the uninterrupted run's losses, bit for bit; with one process's local
directory deleted, that process's shards come from the copy on the other process. Bad local-tier settings: one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bad_inputs import _run_case, _train, assert_one_line_exit_2
from tests.test_multihost import free_port, train_args

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900
STEPS = 20
KILL_AFTER = 16  # on_step(16) runs while step 17 runs: both processes die in step 17
# python -m maxtext.train, whose train() kills its own process (kill -9) once step KILL_AFTER is logged
KILLER = (
  "import os, runpy, signal, sys; from maxtext.train import loop; train = loop.train; "
  "loop.train = lambda c, **k: train(c, **k, on_step=lambda s: s == int(os.environ['KILL_AFTER']) and os.kill(os.getpid(), signal.SIGKILL)); "
  "sys.argv[0] = 'maxtext.train'; runpy.run_module('maxtext.train', run_name='__main__', alter_sys=True)"
)


def tier_args(out: Path, run_name: str) -> tuple[str, ...]:
  return (
    f"learning_rate_schedule_steps={STEPS}",
    f"checkpoint_period={STEPS}",
    "enable_emergency_checkpoint=true",
    f"local_checkpoint_directory={out / ('local_' + run_name)}",
    "local_checkpoint_period=5",
  )


def start(
  out: Path, run_name: str, kill: bool = False, processes: int = 2, steps: int = STEPS, extra: tuple[str, ...] | None = None
) -> list[tuple[subprocess.Popen, Path]]:
  """`processes` processes x 4 CPU devices of the train command (joined on 127.0.0.1), sharing a compilation cache.
  extra: settings beyond the tiny model's (default: this file's local tier)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
    JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    KILL_AFTER=str(KILL_AFTER),
    PYTHONPATH=str(REPO),
  )
  program = ["-c", KILLER] if kill else ["-m", "maxtext.train"]
  args = [sys.executable, *program, *train_args(out, run_name, steps, tier_args(out, run_name) if extra is None else extra)]
  if processes > 1:
    args += [f"jax_coordinator_address=127.0.0.1:{free_port()}", f"jax_num_processes={processes}", "jax_distributed_initialization_timeout=120"]
  procs = []
  for i in range(processes):
    log = out / f"{run_name}.{'killed' if kill else steps}.process{i}.log"
    with open(log, "w") as f:
      extra_id = [f"jax_process_id={i}"] if processes > 1 else []
      procs.append((subprocess.Popen([*args, *extra_id], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO), log))
  return procs


def wait(groups: dict[str, list[tuple[subprocess.Popen, Path]]]) -> dict[str, tuple[list[int], str]]:
  """label -> (exit codes, process 0's output); every process is killed if one hangs."""
  procs = [p for group in groups.values() for p, _ in group]
  try:
    for p in procs:
      p.wait(timeout=TIMEOUT_S)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return {label: ([p.returncode for p, _ in group], group[0][1].read_text()) for label, group in groups.items()}


def losses(out: Path, run_name: str) -> dict[int, float]:
  """step -> loss in the run's metrics file (a resumed step's newest row)."""
  rows = [json.loads(line) for line in (out / run_name / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Phase 1: the uninterrupted run and the run killed in step 17. Phase 2: the killed run restarted, and a copy of
  it restarted with process 1's local directory deleted (a replaced host)."""
  out = tmp_path_factory.mktemp("multi_tier")
  first = wait({"full": start(out, "full"), "killed": start(out, "killed", kill=True)})
  assert first["full"][0] == [0, 0], first["full"][1][-3000:]
  assert all(code != 0 for code in first["killed"][0]), first["killed"][1][-3000:]
  shutil.copytree(out / "killed", out / "replaced")
  shutil.copytree(out / "local_killed" / "killed", out / "local_replaced" / "replaced")
  shutil.rmtree(out / "local_replaced" / "replaced" / "process_1")
  # one resumed run at a time: on a loaded machine two resumed 2-process runs started together were seen to drift more than
  # gloo's 30 s context deadline apart before their first collective
  second = wait({"killed": start(out, "killed")}) | wait({"replaced": start(out, "replaced")})
  for label, (codes, text) in second.items():
    assert codes == [0, 0], f"{label}: {text[-3000:]}"
  return out, first, second


def test_kill_9_resumes_from_the_local_step_with_identical_losses(runs):
  out, first, second = runs
  text = second["killed"][1]
  assert f"restored checkpoint at step 15 from the local checkpoints in {out / 'local_killed' / 'killed'} (every process from its own copy)" in text, text[
    -3000:
  ]
  full, resumed = losses(out, "full"), losses(out, "killed")
  assert sorted(full) == sorted(resumed) == list(range(STEPS))
  assert resumed == full  # bitwise: the same floats
  assert not (out / "killed" / "checkpoints" / "15").exists()  # step 15 was never persistent


def test_a_replaced_host_recovers_its_shards_from_the_peer_copy(runs):
  out, _, second = runs
  text = second["replaced"][1]
  where = "process 1 from the copy on process 0, the others from their own copies"
  assert f"restored checkpoint at step 15 from the local checkpoints in {out / 'local_replaced' / 'replaced'} ({where})" in text, text[-3000:]
  assert losses(out, "replaced") == losses(out, "full")
  assert not (out / "local_replaced" / "replaced" / "process_1" / "20").exists()  # step 20 went to persistent storage
  assert (out / "local_replaced" / "replaced" / "process_1" / "15" / "own.bin").is_file()  # its own copy again
  assert (out / "replaced" / "checkpoints" / "20").is_dir()


@pytest.mark.parametrize(
  "extra, mention",
  [
    (("enable_emergency_checkpoint=true", "local_checkpoint_directory={tmp}/local", "local_checkpoint_period=0"), "local_checkpoint_period"),
    (("enable_multi_tier_checkpointing=true", "local_checkpoint_directory={tmp}/file/local", "local_checkpoint_period=5"), "local_checkpoint_directory"),
  ],
  ids=["period_not_positive", "local_dir_not_writable"],
)
def test_bad_local_tier_settings_are_one_line(tmp_path, extra, mention):
  tmp = tmp_path / "work"
  tmp.mkdir()
  (tmp / "file").write_text("a file, not a directory")
  proc, before, after = _run_case(_train(*extra), tmp, tmp_path / "none", "")
  assert_one_line_exit_2(proc, mention)
  assert before == after  # nothing written


def test_local_files_round_trip_and_refuse_damage():
  """pack/unpack keep every shard's bytes, dtype and sharding (bfloat16 and 0-d included); altered data is refused."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from maxtext.train import local_checkpoints

  mesh = Mesh(np.array(jax.devices()), ("a",))
  state = {
    "w": jax.device_put(jnp.arange(64, dtype=jnp.bfloat16).reshape(8, 8) / 7, NamedSharding(mesh, P("a"))),
    "step": jax.device_put(jnp.int32(7), NamedSharding(mesh, P())),
  }
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
  payload = local_checkpoints.pack(state, {"step": 7})
  back = local_checkpoints.unpack(payload, abstract)
  assert back["w"].dtype == jnp.bfloat16 and back["w"].sharding == state["w"].sharding
  assert np.array_equal(np.asarray(back["w"]), np.asarray(state["w"])) and int(back["step"]) == 7
  damaged = bytearray(payload)
  damaged[-1] ^= 1
  with pytest.raises(ValueError, match="checksum"):
    local_checkpoints.unpack(bytes(damaged), abstract)
