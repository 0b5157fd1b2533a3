"""Run many short `maxtext.train` processes cheaply: import once, then fork one process per job.

`python -m tests.cli_processes < jobs.json > results.json`. The parent imports JAX, Flax, Orbax, grain, TensorBoard
and matplotlib once (no JAX backend is started, no thread runs), then forks a child per job, two at a time. Each
child is a process of its own: it sets its limits, takes stdout and stderr to files, runs `maxtext.train` as the
`__main__` module as `python -m maxtext.train` does, and ends through the interpreter's normal shutdown (its atexit handlers and
thread joins included), so its exit code is the CLI's. What a child skips is only the ~3 s of imports.

A job (JSON): {"argv": [...], "stdout": path, "stderr": path, "cwd": dir, "phase": n (jobs run phase by phase, in
parallel within one), "prepare": [["copy", src, dst] | ["delete", path] | ["write", path, text] | ["snapshot", dir,
json path (hashes(dir))]] (done by the parent just before the child starts), "address_space_extra": bytes (RLIMIT_AS = the address space mapped at fork + this),
"no_memory_check": true (the preflight memory check is switched off, to reach an out-of-memory error at run time),
"signals": [[line prefix or null, delay seconds, "SIGTERM"], ...] (each sent `delay` after the child printed a line
starting with the prefix; null: after the previous signal)}. A result: {"code", "stdout", "stderr", "delivered"
(per signal: whether the child was still running when it was sent), "seconds", "cpu_seconds"}.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import runpy
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

PARALLEL = 2
TIMEOUT_SECONDS = 300.0


class _Child(BaseException):
  """Raised in a freshly forked child to leave the parent's loop; the module's top level runs the job."""

  def __init__(self, job: dict[str, Any]):
    super().__init__()
    self.job = job


def _preimport() -> None:
  import matplotlib

  matplotlib.use("Agg")
  import grain  # noqa: F401
  import matplotlib.pyplot  # noqa: F401

  from maxtext.tensorboard_import import import_tensorboardx

  import_tensorboardx()  # as a run imports it: without torch

  import maxtext.cli  # noqa: F401 - not maxtext.train.__main__: the child runs that module as __main__
  import maxtext.data.pipeline  # noqa: F401
  import maxtext.models  # noqa: F401
  import maxtext.plot  # noqa: F401
  import maxtext.train.loop  # noqa: F401


def _vm_size() -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmSize:"):
      return int(line.split()[1]) * 1024
  return 0


def _run_child(job: dict[str, Any]) -> None:
  os.chdir(job.get("cwd", "."))
  if job.get("address_space_extra"):
    limit = _vm_size() + int(job["address_space_extra"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  if job.get("no_memory_check"):
    from maxtext.train import preflight

    preflight.check_memory_fit = lambda *args: None
  sys.argv = ["maxtext.train", *job["argv"]]
  runpy.run_module("maxtext.train", run_name="__main__", alter_sys=True)  # what `python -m maxtext.train` does


def hashes(root: Path) -> dict[str, str]:
  """Every path under root with the SHA-256 of its bytes ('dir' for a directory)."""
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def _prepare(actions: list[list[str]]) -> None:
  for action, *args in actions:
    if action == "copy":
      shutil.copytree(args[0], args[1])
    elif action == "delete":
      Path(args[0]).unlink()
    elif action == "write":
      Path(args[0]).write_text(args[1])
    elif action == "snapshot":
      Path(args[1]).write_text(json.dumps(hashes(Path(args[0]))))
    else:
      raise ValueError(f"unknown prepare action {action}")


class _Running:
  def __init__(self, job: dict[str, Any]):
    _prepare(job.get("prepare", []))
    self.job = job
    self.signals = [list(s) for s in job.get("signals", [])]
    self.delivered: list[bool] = []
    self.armed_at: float | None = None  # when the next signal's trigger was seen
    self.began = time.monotonic()
    self.status: int | None = None
    out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      os.dup2(out, 1)
      os.dup2(err, 2)
      raise _Child(job)
    os.close(out)
    os.close(err)
    self.pid = pid

  def _exited(self) -> bool:
    if self.status is None:
      pid, status, usage = os.wait4(self.pid, os.WNOHANG)
      if pid:
        self.status, self.cpu = status, usage.ru_utime + usage.ru_stime
    return self.status is not None

  def step(self) -> bool:
    """Send what is due; True once the child has ended."""
    while self.signals and not self._exited():
      prefix, delay, name = self.signals[0]
      if self.armed_at is None:
        if prefix is not None and not any(line.startswith(prefix) for line in Path(self.job["stdout"]).read_text().splitlines()):
          break
        self.armed_at = time.monotonic()
      if time.monotonic() - self.armed_at < delay:
        break
      alive = not self._exited()
      if alive:
        os.kill(self.pid, getattr(signal, name))
      self.delivered.append(alive)
      self.signals.pop(0)
      self.armed_at = time.monotonic() if self.signals and self.signals[0][0] is None else None
    if not self._exited() and time.monotonic() - self.began > TIMEOUT_SECONDS:
      os.kill(self.pid, signal.SIGKILL)
      os.waitpid(self.pid, 0)
      self.status, self.cpu = -1, 0.0
    return self._exited()

  def result(self) -> dict[str, Any]:
    code = os.waitstatus_to_exitcode(self.status) if self.status != -1 else "timeout"
    read = lambda key: Path(self.job[key]).read_text(errors="replace")  # noqa: E731
    self.delivered += [False] * len(self.signals)  # the child ended before their triggers
    seconds = time.monotonic() - self.began
    return {"code": code, "stdout": read("stdout"), "stderr": read("stderr"), "delivered": self.delivered, "seconds": seconds, "cpu_seconds": self.cpu}


def run_all(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
  results: list[dict[str, Any] | None] = [None] * len(jobs)
  for phase in sorted({job.get("phase", 0) for job in jobs}):
    waiting = [i for i, job in enumerate(jobs) if job.get("phase", 0) == phase]
    running: dict[int, _Running] = {}
    while waiting or running:
      while waiting and len(running) < PARALLEL:
        i = waiting.pop(0)
        running[i] = _Running(jobs[i])
      for i, child in list(running.items()):
        if child.step():
          results[i] = child.result()
          del running[i]
      time.sleep(0.002)
  return results  # type: ignore[return-value]


if __name__ == "__main__":
  try:
    _jobs = json.load(sys.stdin)
    _preimport()
    json.dump(run_all(_jobs), sys.stdout)
  except _Child as child:
    sys.exit(_run_child(child.job))
