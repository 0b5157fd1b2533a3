"""GRPO's reward functions in a worker process, so that a function that hangs or exhausts memory stops the run with
one line naming it, and a SIGTERM or Ctrl-C ends the run as it does everywhere else.

The worker is a fresh interpreter (`python -m maxtext.train.reward_worker`) with the trainer's sys.path. It imports
the reward modules once, under a memory limit (grpo_reward_memory_gib, as RLIMIT_DATA: a function that allocates
past it gets a MemoryError), and then scores one (function, rollout batch) per request over two pipes; one worker
serves every step of a process's runs with the same functions. The trainer waits for each answer in short slices:
past grpo_reward_timeout_s, or when a signal asks the run to stop, it kills the worker (`Interrupted` then lets the
run save its last whole step and exit as any preempted run). The worker ignores SIGINT (a Ctrl-C reaches the whole
process group; the trainer decides) and ends itself when the trainer is gone, killed or not.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from maxtext.errors import ConfigError, DataError, UserError

POLL_SECONDS = 0.1  # how often a wait checks for a stop request
PARENT_CHECK_SECONDS = 0.5  # how often the worker checks that the trainer still runs


class Interrupted(Exception):
  """A SIGTERM or SIGINT asked the run to stop while a reward function ran: the worker is killed, the step dropped."""


def never() -> bool:
  return False


class RewardWorker:
  """The reward functions `entries` ('module:function'), imported in a worker process; score() calls one of them."""

  def __init__(self, entries: Sequence[str], timeout_s: float, memory_gib: float):
    self.entries = [str(e) for e in entries]
    self.timeout_s = float(timeout_s)
    self.memory_gib = float(memory_gib)
    request_read, request_write = os.pipe()
    reply_read, reply_write = os.pipe()
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p))
    argv = [sys.executable, "-m", "maxtext.train.reward_worker", str(request_read), str(reply_write), str(int(self.memory_gib * 2**30)), str(os.getpid())]
    try:
      self.process = subprocess.Popen(argv, pass_fds=(request_read, reply_write), env=env, stdin=subprocess.DEVNULL)
    finally:
      os.close(request_read)
      os.close(reply_write)
    self._requests = Connection(request_write, readable=False)
    self._replies = Connection(reply_read, writable=False)
    self._finalizer = weakref.finalize(self, _stop, self.process, self._requests, self._replies)
    self._call(("load", self.entries, _parent_path()), "importing grpo_reward_functions", ConfigError, never)

  @property
  def alive(self) -> bool:
    return self._finalizer.alive and self.process.poll() is None

  def score(
    self,
    index: int,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
    where: list[str],
    interrupted: Callable[[], bool] = never,
  ) -> np.ndarray:
    """float64 [completions] from function `index`; a DataError naming it when it fails, returns something else than
    one finite number per completion, runs past grpo_reward_timeout_s or ends the worker; Interrupted when
    interrupted() turns true while it runs."""
    payload = pickle.dumps((prompts, completions, columns, where))
    return self._call(("score", index, payload), f"reward function '{self.entries[index]}'", DataError, interrupted)

  def close(self) -> None:
    self._finalizer()

  def _call(self, request: tuple, what: str, error: type[UserError], interrupted: Callable[[], bool]) -> Any:
    if not self.alive:
      raise error(f"{what}: the reward worker process has ended; start the run again")
    try:
      self._requests.send(request)
      deadline = time.monotonic() + self.timeout_s
      while not self._replies.poll(POLL_SECONDS):
        if interrupted():
          self.close()
          raise Interrupted
        if time.monotonic() > deadline:
          self.close()
          raise error(
            f"{what} did not return within grpo_reward_timeout_s={self.timeout_s:g} seconds and was stopped; "
            "fix the function (does it wait for something?) or raise grpo_reward_timeout_s"
          )
      reply = self._replies.recv()
    except (EOFError, OSError):
      raise error(
        f"{what} ended the reward worker process ({self._ending()}); fix the function (or raise grpo_reward_memory_gib if it needs more memory)"
      ) from None
    except BaseException:  # a second Ctrl-C (KeyboardInterrupt), Interrupted, the errors above: the worker goes with the step
      self.close()
      raise
    if reply[0] == "error":
      if reply[1] == "fatal":
        self.close()
      raise error(reply[2])
    return reply[1]

  def _ending(self) -> str:
    try:
      code = self.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self.close()
      return "it stopped answering"
    self.close()
    if code < 0:
      return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


_SHARED: dict[tuple, RewardWorker] = {}


def shared(entries: Sequence[str], timeout_s: float, memory_gib: float) -> RewardWorker:
  """This process's worker for these functions and limits: started (and its modules imported) once, reused by every
  later run of the process while it lives (a run that stopped it starts a new one)."""
  key = (tuple(str(e) for e in entries), float(timeout_s), float(memory_gib))
  worker = _SHARED.get(key)
  if worker is None or not worker.alive:
    worker = _SHARED[key] = RewardWorker(entries, timeout_s, memory_gib)
  return worker


def _parent_path() -> list[str]:
  """The trainer's sys.path, '' (the working directory) made absolute: the worker imports modules as the trainer would."""
  return [os.path.abspath(p) if p == "" else p for p in sys.path]


def _stop(process: subprocess.Popen, *connections: Connection) -> None:
  for c in connections:
    try:
      c.close()
    except OSError:
      pass
  if process.poll() is None:
    process.kill()
  try:
    process.wait(timeout=10)
  except subprocess.TimeoutExpired:
    pass


# --- the worker process -----------------------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
  """End this process once the trainer is gone (even when it was killed with SIGKILL)."""
  while True:
    time.sleep(PARENT_CHECK_SECONDS)
    if os.getppid() != parent:
      os._exit(1)


def serve(requests: Connection, replies: Connection, memory_limit: str) -> None:
  """Answer requests until the trainer closes the pipe: ('load', entries, sys.path) imports the functions,
  ('score', index, pickled arguments) calls one; each answer is ('ok', value) or ('error', kind, one line)."""
  from maxtext.train import rewards as rewards_lib

  loaded: list[rewards_lib.Reward] = []
  while True:
    try:
      request = requests.recv()
    except (EOFError, OSError):
      return
    try:
      if request[0] == "load":
        _, entries, path = request
        sys.path[:] = path + [p for p in sys.path if p not in path]
        loaded = rewards_lib.load(entries)
        value = None
      else:
        _, index, payload = request
        prompts, completions, columns, where = pickle.loads(payload)
        value = rewards_lib.score(loaded[index], prompts, completions, columns, where, memory_limit)
      reply: tuple = ("ok", value)
    except UserError as e:
      reply = ("error", "user", str(e))
    except BaseException as e:  # noqa: BLE001 - whatever escapes (a MemoryError while answering): one line, then this worker ends
      reply = ("error", "fatal", f"the reward worker failed ({type(e).__name__}: {str(e)[:200]}); fix the reward functions or raise grpo_reward_memory_gib")
    replies.send(reply)
    if reply[:2] == ("error", "fatal"):
      return


def main(argv: list[str]) -> None:
  request_fd, reply_fd, memory_bytes, parent = (int(a) for a in argv)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer decides
  threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
  if os.getppid() != parent:
    os._exit(1)
  memory_limit = "the host's memory"
  if memory_bytes > 0:
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    try:
      resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard), hard))
      memory_limit = f"grpo_reward_memory_gib={memory_bytes / 2**30:g}"
    except (ValueError, OSError):  # a platform without RLIMIT_DATA: the functions share the host's memory
      pass
  serve(Connection(request_fd, writable=False), Connection(reply_fd, readable=False), memory_limit)


if __name__ == "__main__":
  main(sys.argv[1:])
