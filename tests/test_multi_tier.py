"""The local checkpoint tier on 2 processes x 4 CPU devices: kill -9 both at step 17 (local period 5, persistent
period 20), delete process 1's local directory (a replaced host), restart: it resumes from the local step 15, process 1's
shards from the copy on process 0, with the uninterrupted run's losses, bit for bit. In one process: the minutes-based
persistent backup, the restart from a process's own local copy and from persistent storage. Bad local-tier settings:
one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_bad_inputs import _run_case, _train, assert_one_line_exit_2
from tests.test_multihost import free_port, train_args
from tests.xla_env import xla_flags

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
    XLA_FLAGS=xla_flags(4),
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
  """Phase 1: the uninterrupted run and the run killed in step 17. Phase 2: the killed run restarted with process 1's
  local directory deleted (a replaced host). The restart restores process 0's shards from its own copy and process
  1's from the copy on process 0, so it covers both kinds of local restore (one process's own copy alone:
  test_backup_interval_minutes_and_the_persistent_fallback)."""
  out = tmp_path_factory.mktemp("multi_tier")
  first = wait({"full": start(out, "full"), "killed": start(out, "killed", kill=True)})
  assert first["full"][0] == [0, 0], first["full"][1][-3000:]
  assert all(code != 0 for code in first["killed"][0]), first["killed"][1][-3000:]
  assert sorted(int(d.name) for d in (out / "local_killed" / "killed" / "process_1").iterdir()) == [10, 15]  # the newest 2 local steps
  shutil.rmtree(out / "local_killed" / "killed" / "process_1")
  second = wait({"killed": start(out, "killed")})
  assert second["killed"][0] == [0, 0], second["killed"][1][-3000:]
  return out, first, second


def test_kill_9_resumes_from_the_local_step_with_identical_losses(runs):
  out, first, second = runs
  text = second["killed"][1]
  assert f"restored checkpoint at step 15 from the local checkpoints in {out / 'local_killed' / 'killed'} (" in text, text[-3000:]
  full, resumed = losses(out, "full"), losses(out, "killed")
  assert sorted(full) == sorted(resumed) == list(range(STEPS))
  assert resumed == full  # bitwise: the same floats (steps 15-19 from the restart)
  assert not (out / "killed" / "checkpoints" / "15").exists()  # step 15 was never persistent
  assert (out / "killed" / "checkpoints" / "20").is_dir()


def test_a_replaced_host_recovers_its_shards_from_the_peer_copy(runs):
  out, _, second = runs
  text = second["killed"][1]
  where = "process 1 from the copy on process 0, the others from their own copies"
  assert f"restored checkpoint at step 15 from the local checkpoints in {out / 'local_killed' / 'killed'} ({where})" in text, text[-3000:]
  assert not (out / "local_killed" / "killed" / "process_1" / "20").exists()  # step 20 went to persistent storage
  assert (out / "local_killed" / "killed" / "process_1" / "15" / "own.bin").is_file()  # its own copy again


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


class Crash(RuntimeError):
  """Stands for a kill: nothing is saved after it."""


def test_backup_interval_minutes_and_the_persistent_fallback(tmp_path, monkeypatch, capsys):
  """One process, a local save every step, multi_tier_checkpointing_backup_interval_minutes=3, and a clock that
  moves one minute per logged step (the loop's clock, nothing sleeps): a local save becomes persistent once 3
  minutes have passed since the last persistent save, so steps 4 and 8 are persistent and the others local. The run
  dies once step 9 is logged; its restart takes local step 9 (newer than persistent step 8), and a restart whose
  local directory is gone takes persistent step 8; each says which, and both compute step 9's loss alike."""
  import types

  from maxtext.train import checkpoint_files, loop
  from maxtext.train import setup as setup_lib
  from tests.test_train_helpers import mesh_for, tiny_config

  clock = [0.0]
  monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=time.perf_counter, monotonic=lambda: clock[0]))

  def config_for(out: Path, local: Path):
    return tiny_config(
      num_devices=1,
      base_output_directory=str(out),
      run_name="mt",
      steps=10,
      learning_rate_schedule_steps=10,
      checkpoint_period=100,
      enable_multi_tier_checkpointing=True,
      local_checkpoint_directory=str(local),
      local_checkpoint_period=1,
      multi_tier_checkpointing_backup_interval_minutes=3,
    )

  config = config_for(tmp_path / "out", tmp_path / "local")
  setup = setup_lib.build(config, mesh_for(config))  # one compiled step for every attempt

  def minute_per_step(step: int) -> None:
    clock[0] += 60
    if step == 9:
      raise Crash

  with pytest.raises(Crash):
    loop.train(config, setup=setup, on_step=minute_per_step)
  assert checkpoint_files.saved_steps(config.checkpoint_dir) == [4, 8]
  assert sorted(int(d.name) for d in (tmp_path / "local" / "mt" / "process_0").iterdir()) == [7, 9]  # the newest 2 local steps
  without = config_for(tmp_path / "out_lost", tmp_path / "local_lost")  # a copy of the run whose local directory is gone
  shutil.copytree(tmp_path / "out", tmp_path / "out_lost")
  capsys.readouterr()
  local = loop.train(config, setup=setup)
  said = capsys.readouterr().out
  assert f"restored checkpoint at step 9 from the local checkpoints in {tmp_path / 'local' / 'mt'} (every process from its own copy)" in said, said[-2000:]
  persistent = loop.train(without, setup=setup)
  said = capsys.readouterr().out
  assert f"restored checkpoint at step 8 from persistent storage {without.checkpoint_dir}" in said, said[-2000:]
  assert sorted(local.losses) == [9] and sorted(persistent.losses) == [8, 9]
  assert local.losses[9] == persistent.losses[9]
