"""Run `python -m maxtext.<entry> ...` commands as real processes without paying ~3 s of imports each.

A test calls `run(argv, cwd=..., env=..., timeout=...)` as it would call `subprocess.run(argv, capture_output=True,
text=True, ...)`. For `[sys.executable, "-m", "maxtext...", ...]` the command goes to a server process (one per test
process and environment) that imported JAX, Flax, Orbax, grain, TensorBoard and the maxtext entry points once, started
no JAX backend and no thread, and forks one child per command. The child is a process of its own: stdin /dev/null,
stdout and stderr to files, the command's working directory and environment, `sys.path[0]` that directory, and the
entry run as `__main__` as `python -m` does; it ends through the interpreter's normal shutdown, so its exit code is the
CLI's. What it skips is only the imports. Any other argv runs with subprocess.run.

Protocol (JSON lines): requests on the server's stdin, {"id", "module", "args", "cwd", "env", "stdout", "stderr"} or
{"kill": id}; replies on its stdout, {"ready": true} once its imports are done (a command's timeout counts from then,
as a new process's would count from its own imports), then {"id", "code"} per command. EOF on stdin kills what still runs and ends the server.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_SECONDS = 900  # the server's imports, once; on a busy machine they can take minutes


class _Child(BaseException):
  """Raised in a freshly forked child to leave the server's loop; the module's top level runs the command."""

  def __init__(self, request: dict[str, Any]):
    super().__init__()
    self.request = request


def _preimport() -> None:
  import matplotlib

  matplotlib.use("Agg")
  import grain  # noqa: F401
  import matplotlib.pyplot  # noqa: F401

  from maxtext.tensorboard_import import import_tensorboardx

  import_tensorboardx()  # as a run imports it: without torch

  import maxtext.cli  # noqa: F401
  import maxtext.convert  # noqa: F401
  import maxtext.data.pipeline  # noqa: F401
  import maxtext.eval  # noqa: F401
  import maxtext.inference.cli  # noqa: F401
  import maxtext.models  # noqa: F401
  import maxtext.plot  # noqa: F401
  import maxtext.train.loop  # noqa: F401


def _serve() -> None:
  """Fork a child per request; report each child's exit code. Runs until stdin closes."""
  children: dict[int, str] = {}  # pid -> request id
  by_id: dict[str, int] = {}
  buffer = b""
  stdin = sys.stdin.fileno()
  sys.stdout.write(json.dumps({"ready": True}) + "\n")
  sys.stdout.flush()
  open_ = True
  while open_ or children:
    if open_ and select.select([stdin], [], [], 0.005)[0]:
      chunk = os.read(stdin, 65536)
      if not chunk:
        open_ = False
        for pid in children:
          os.kill(pid, signal.SIGKILL)
      buffer += chunk
      while b"\n" in buffer:
        line, buffer = buffer.split(b"\n", 1)
        request = json.loads(line)
        if "kill" in request:
          if request["kill"] in by_id:
            os.kill(by_id[request["kill"]], signal.SIGKILL)
          continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
          raise _Child(request)
        children[pid] = request["id"]
        by_id[request["id"]] = pid
    while children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if not pid:
        break
      rid = children.pop(pid)
      by_id.pop(rid, None)
      sys.stdout.write(json.dumps({"id": rid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
      sys.stdout.flush()


def _run_child(request: dict[str, Any]) -> None:
  null = os.open(os.devnull, os.O_RDONLY)
  out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  for fd, target in ((null, 0), (out, 1), (err, 2)):
    os.dup2(fd, target)
    os.close(fd)
  os.environ.clear()
  os.environ.update(request["env"])
  os.chdir(request["cwd"])
  sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
  sys.argv = [request["module"], *request["args"]]
  sys.modules.pop(request["module"], None)  # `python -m` runs a module that nothing imported yet (and runpy warns otherwise)
  runpy.run_module(request["module"], run_name="__main__", alter_sys=True)  # what `python -m module` does


class _Server:
  def __init__(self, env: dict[str, str]):
    self.log = tempfile.TemporaryFile()  # what the server itself prints on stderr (its imports): import_output()
    self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=REPO, env=env)
    self.lock = threading.Lock()
    self.ready = threading.Event()  # set once the server has imported everything: a command's timeout starts then
    self.waiting: dict[str, tuple[threading.Event, list[int]]] = {}
    self.next_id = 0
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      reply = json.loads(line)
      if "ready" in reply:
        self.ready.set()
        continue
      with self.lock:
        event, code = self.waiting.pop(reply["id"])
      code.append(reply["code"])
      event.set()
    self.ready.set()
    with self.lock:  # the server died: fail whoever waits
      for event, code in self.waiting.values():
        code.append(-9)
        event.set()
      self.waiting.clear()

  def _send(self, request: dict[str, Any]) -> None:
    self.proc.stdin.write((json.dumps(request) + "\n").encode())
    self.proc.stdin.flush()

  def run(self, argv: list[str], cwd: str, env: dict[str, str], timeout: float | None) -> subprocess.CompletedProcess:
    self.ready.wait(STARTUP_TIMEOUT_SECONDS)
    with tempfile.TemporaryDirectory(prefix="cli_server_") as scratch:
      event, code = threading.Event(), []
      with self.lock:
        rid = str(self.next_id)
        self.next_id += 1
        self.waiting[rid] = (event, code)
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        self._send({"id": rid, "module": argv[2], "args": argv[3:], "cwd": cwd, "env": env, "stdout": out, "stderr": err})
      if not event.wait(timeout):
        with self.lock:
          self._send({"kill": rid})
        event.wait()
        read = lambda path: Path(path).read_text(errors="replace") if os.path.exists(path) else ""  # noqa: E731
        raise subprocess.TimeoutExpired(argv, timeout, read(out), read(err))
      return subprocess.CompletedProcess(argv, code[0], Path(out).read_text(), Path(err).read_text())

  def output(self) -> str:
    self.ready.wait(STARTUP_TIMEOUT_SECONDS)
    self.log.seek(0)
    return self.log.read().decode(errors="replace")

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait(timeout=60)
    self.log.close()


_SERVERS: dict[tuple, _Server] = {}
_SERVERS_LOCK = threading.Lock()


def _server(env: dict[str, str]) -> _Server:
  """The server for this environment (pytest's PYTEST_CURRENT_TEST aside: each child gets the request's exact one)."""
  key = tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))
  with _SERVERS_LOCK:
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
      _SERVERS[key] = _Server(env)
    return _SERVERS[key]


def import_output(env: dict[str, str]) -> str:
  """What the server for this environment printed on stderr while it imported (a forked command's output lacks it)."""
  return _server(env).output()


def close_all() -> None:
  """End every server (each holds its imports in memory); a later run() starts a new one."""
  with _SERVERS_LOCK:
    for server in _SERVERS.values():
      server.close()
    _SERVERS.clear()


atexit.register(close_all)


def run(argv: list[str], *, env: dict[str, str], cwd: str | Path | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
  """subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout), forked from a warm server for maxtext entries."""
  if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2].split(".")[0] == "maxtext":
    return _server(env).run([str(a) for a in argv], str(cwd or os.getcwd()), dict(env), timeout)
  return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


if __name__ == "__main__":
  try:
    _preimport()
    _serve()
  except _Child as child:
    _run_child(child.request)
