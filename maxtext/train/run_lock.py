"""One writer per run directory: `<run dir>/run.lock` holds the writer's host and pid while it runs.

The lock is taken once per run (by process 0; every process learns the outcome). It is free when absent,
or left by a process that is gone: on this host a pid that no longer runs (or an unheld flock), on another
host a heartbeat older than STALE_SECONDS. A live holder refuses the second run with a one-line error.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from maxtext.errors import UserError

LOCK_NAME = "run.lock"
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0  # another host's lock not refreshed for this long is left by a dead run


class RunLockedError(UserError):
  """Another live run writes into this run directory."""


def run_dir(checkpoint_dir: str) -> str:
  """<base_output_directory>/<run_name>: the parent of checkpoint_dir."""
  return os.path.dirname(checkpoint_dir.rstrip("/"))


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by another user
    return True
  return True


def _describe(holder: dict[str, Any]) -> str:
  return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} (since {holder.get('started', '?')})"


class RunLock:
  """An exclusive lock on one run directory; `acquire` raises RunLockedError naming a live holder."""

  def __init__(self, directory: str, log: Callable[[str], None] = print):
    self.directory = directory
    self.path = os.path.join(directory, LOCK_NAME)
    self.log = log
    self._fd: int | None = None
    self._made: list[str] = []
    self._stop = threading.Event()
    self._heartbeat: threading.Thread | None = None

  def acquire(self) -> None:
    self._made = []  # the directories this lock creates, innermost first
    d = os.path.abspath(self.directory)
    while not os.path.isdir(d) and os.path.dirname(d) != d:
      self._made.append(d)
      d = os.path.dirname(d)
    os.makedirs(self.directory, exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:  # a live process holds it
        holder = self._read(fd)
        os.close(fd)
        raise RunLockedError(self._refusal(holder)) from None
      except OSError:  # no flocks on this filesystem: the recorded holder decides
        pass
      if self._same_file(fd):
        break
      os.close(fd)  # the holder released (unlinked) it between our open and flock: try the new file
    holder = self._read(fd)
    if holder and self._held_by_other_live_run(holder):
      os.close(fd)
      raise RunLockedError(self._refusal(holder))
    if holder:
      self.log(f"took over the run lock {self.path} left by {_describe(holder)}, which is no longer running")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    self._heartbeat = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
    self._heartbeat.start()

  def _refusal(self, holder: dict[str, Any]) -> str:
    return (
      f"run directory {self.directory} is in use by another run ({_describe(holder)}); wait for it to finish, "
      f"use another run_name, or delete {self.path} if that run is gone"
    )

  def _same_file(self, fd: int) -> bool:
    try:
      return os.path.samestat(os.fstat(fd), os.stat(self.path))
    except FileNotFoundError:
      return False

  @staticmethod
  def _read(fd: int) -> dict[str, Any]:
    try:
      data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
      return data if isinstance(data, dict) else {}
    except (ValueError, UnicodeDecodeError):
      return {}

  def _held_by_other_live_run(self, holder: dict[str, Any]) -> bool:
    """A recorded holder whose flock we could still take: alive only if its pid runs here, or on another host it still beats."""
    if holder.get("host") == socket.gethostname():
      pid = int(holder.get("pid", -1))
      return pid != os.getpid() and pid > 0 and _pid_alive(pid)
    return time.time() - os.stat(self.path).st_mtime < STALE_SECONDS

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_SECONDS):
      with contextlib.suppress(OSError):
        os.utime(self.path)

  def release(self) -> None:
    if self._fd is None:
      return
    self._stop.set()
    with contextlib.suppress(OSError):
      os.unlink(self.path)
    os.close(self._fd)
    self._fd = None
    for d in self._made:  # a run that wrote nothing else (e.g. failed before its first save) leaves no directory behind
      try:
        os.rmdir(d)
      except OSError:  # not empty: the run wrote into it
        break


@contextlib.contextmanager
def hold(directory: str, log: Callable[[str], None] = print) -> Iterator[None]:
  """Hold the run lock of `directory` for the block: process 0 takes it, all processes share the outcome."""
  import jax

  if "://" in directory:  # object stores offer no flock or pid to check here
    log(f"note: no run lock on {directory} (a remote path); make sure only one run writes into it")
    yield
    return
  lock = RunLock(directory, log)
  error = ""
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except RunLockedError as e:
      error = str(e)
  if jax.process_count() > 1:
    import numpy as np
    from jax.experimental import multihost_utils

    refused = bool(multihost_utils.broadcast_one_to_all(np.asarray(bool(error))))
    if refused and not error:
      error = f"run directory {directory} is in use by another run (process 0 names the holder); use another run_name"
  if error:
    raise RunLockedError(error)
  try:
    yield
  finally:
    lock.release()
