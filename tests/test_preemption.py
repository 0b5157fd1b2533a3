"""Preemption as it happens: real processes killed (-9) or signalled (SIGTERM/SIGINT) at seeded random moments.

Each interrupted run is restarted with the same command; the final parameters must be bitwise equal to those
of an uninterrupted run. A SIGTERM just after the last step (while the final async save is in flight) must end
in exit 0, one message and a complete final checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.test_train_helpers import TINY_MODEL
from tests.xla_env import xla_flags

REPO = Path(__file__).resolve().parents[1]
STEPS = 24
TINY = dict(
  **TINY_MODEL,
  enable_tensorboard="false",
  async_checkpointing="true",
  steps=STEPS,
  learning_rate_schedule_steps=STEPS,
  checkpoint_period=4,
  run_name="r",
)


def _command(out: Path, **extra) -> list[str]:
  keys = {**TINY, "base_output_directory": str(out), **extra}
  return [sys.executable, "-m", "maxtext.train", str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


def _env() -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), PYTHONPATH=str(REPO))


class Run:
  """A training process whose stdout lines are collected as they come."""

  def __init__(self, out: Path, **extra):
    self.proc = subprocess.Popen(_command(out, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    self.lines: list[str] = []
    self.err: list[str] = []
    self._readers = [threading.Thread(target=self._read, args=(f, to), daemon=True) for f, to in ((self.proc.stdout, self.lines), (self.proc.stderr, self.err))]
    for r in self._readers:
      r.start()

  @staticmethod
  def _read(stream, into: list[str]) -> None:
    for line in stream:
      into.append(line.rstrip("\n"))

  def wait_for(self, prefix: str, timeout: float = 300) -> bool:
    """True once a stdout line starts with prefix; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if any(line.startswith(prefix) for line in self.lines):
        return True
      if self.proc.poll() is not None:
        self._readers[0].join(5)
        return any(line.startswith(prefix) for line in self.lines)
      time.sleep(0.01)
    raise TimeoutError(f"no line starting with {prefix!r}: {self.lines[-5:]}")

  def finish(self, timeout: float = 300) -> tuple[int, str]:
    self.proc.wait(timeout=timeout)
    for r in self._readers:
      r.join(5)
    return self.proc.returncode, "\n".join(self.err)


def final_params(out: Path, step: int = STEPS) -> list[np.ndarray]:
  item = out / "r" / "checkpoints" / str(step) / "items"
  with ocp.PyTreeCheckpointer() as ckptr:
    tree = ckptr.metadata(item).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = ckptr.restore(item, restore_args=args)
  return jax.tree.leaves(restored["params"])


def _uninterrupted(out: Path) -> list[np.ndarray]:
  code, err = Run(out).finish()
  assert code == 0, err[-2000:]
  return final_params(out)


def _sigterm_after_last_step(out: Path) -> tuple[int, str, list[str]]:
  run = Run(out)
  assert run.wait_for(f"completed step: {STEPS - 1},")
  time.sleep(0.1)  # the final async save is in flight
  run.proc.send_signal(signal.SIGTERM)
  code, err = run.finish()
  return code, err, run.lines


def _interrupted_chain(out: Path, seed: int) -> list[tuple[str, int, list[str]]]:
  """kill -9, SIGTERM, SIGINT at random moments after training starts, each followed by a restart; then a run to the end."""
  rng = random.Random(seed)
  trials = []
  for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
    run = Run(out)
    if run.wait_for("training r from step"):
      time.sleep(rng.uniform(0.0, 0.4))
      run.proc.send_signal(sig)
    code, err = run.finish()
    trials.append((sig.name, code, run.lines, err))
  code, err = Run(out).finish()
  assert code == 0, err[-2000:]
  return trials


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The uninterrupted run, the SIGTERM-after-the-last-step run and the interrupted chain, concurrently."""
  dirs = {name: tmp_path_factory.mktemp(name) for name in ("full", "last", "chain")}
  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    full = pool.submit(_uninterrupted, dirs["full"])
    last = pool.submit(_sigterm_after_last_step, dirs["last"])
    chain = pool.submit(_interrupted_chain, dirs["chain"], 16)
    return dirs, full.result(), last.result(), chain.result()


def test_sigterm_just_after_the_last_step_saves_it_and_exits_0(runs):
  dirs, reference, (code, err, lines), _ = runs
  assert code == 0, err[-2000:]
  assert "Traceback" not in err
  said = [line for line in lines if line.startswith("received SIGTERM")]
  assert len(said) == 1 and f"after step {STEPS - 1}" in said[0]
  ckpts = os.listdir(dirs["last"] / "r" / "checkpoints")
  assert str(STEPS) in ckpts and not any("tmp" in name for name in ckpts)
  assert all(np.array_equal(a, b) for a, b in zip(final_params(dirs["last"]), reference, strict=True))


def test_kill_and_signals_at_random_moments_lose_nothing(runs):
  dirs, reference, _, trials = runs
  for name, code, lines, err in trials:
    finished = any(line.startswith(f"completed step: {STEPS - 1},") for line in lines)
    if name == "SIGKILL":
      assert code in (-9, 0), err[-2000:]
    else:  # a signal ends in a saved step, a message and exit 0
      assert code == 0 and "Traceback" not in err, err[-2000:]
      assert finished or any(line.startswith(f"received {name}") for line in lines), lines[-3:]
  assert all(np.array_equal(a, b) for a, b in zip(final_params(dirs["chain"]), reference, strict=True))
  assert not os.path.exists(dirs["chain"] / "r" / "run.lock")  # released by the last run (taken over after kill -9)
