"""Chat templates run bounded: compiled and rendered in a renderer process with a deadline and a memory limit.

A chat template is user code (Jinja). Rendering it in the trainer could hang it (nested loops), exhaust its memory
(`{{ 'x' * 300000000 }}`) or crash it (deep recursion). So one renderer process per process that renders
(maxtext/data/template_worker.py, started on first use) compiles the template in Jinja's immutable sandbox and
renders each conversation into prompt and completion pieces. It limits its own address space to
MAX_RENDER_BYTES and each render's output to MAX_RENDER_CHARS characters; this side waits at most
RENDER_SECONDS for an answer and kills it when it is late. Whatever fails is one error naming the template and
the cause.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from maxtext.errors import ConfigError, DataError

RENDER_SECONDS = 10.0  # the most compiling the template, or rendering one conversation (all its prefixes), may take
START_SECONDS = 60.0  # the most starting the renderer process (Python and jinja2) may take on a busy host
MAX_RENDER_CHARS = 1 << 24  # the most characters one render of a conversation may produce
MAX_RENDER_BYTES = 1 << 30  # the renderer process's address-space limit
WORKER = Path(__file__).with_name("template_worker.py")
NOT_PREFIX = "not_prefix"  # template_worker.NOT_PREFIX

# (text, trainable): completion pieces are trained on; prompt pieces may get zero loss weight.
Piece = tuple[str, bool]


@dataclasses.dataclass(frozen=True)
class TemplateSource:
  """A chat template's text and where it came from, as errors name it."""

  text: str
  origin: str  # "chat_template", "chat_template_path '/t.jinja'" or "the tokenizer's own template in '/tok'"


class Late(Exception):
  """The renderer did not answer in time."""


class Ended(Exception):
  """The renderer process ended."""


class ChatTemplate:
  """A compiled chat template: `pieces(messages, special_tokens, where)`; thread-safe, picklable (as its source)."""

  def __init__(self, source: TemplateSource, start: bool = True):
    self.source = source
    self._lock = threading.Lock()
    self._proc: subprocess.Popen | None = None
    self._owner = 0  # the pid that started _proc (a forked copy starts its own)
    self._buffer = bytearray()
    if start:
      with self._lock:
        self._start()

  def __getstate__(self) -> dict[str, Any]:
    return {"source": self.source}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state["source"], start=False)  # started where it renders

  def pieces(self, messages: list[dict[str, str]], special_tokens: dict[str, str], where: str) -> list[Piece]:
    """The conversation's pieces; a failing, late or oversized render is a DataError naming where and the template."""
    request = json.dumps({"messages": messages, "special": special_tokens}) + "\n"
    with self._lock:
      if self._proc is None or self._owner != os.getpid():
        self._start()
      try:
        answer = self._ask(request.encode(), RENDER_SECONDS)
      except Late:
        self.close_locked()
        raise DataError(
          f"{where}: the chat template ({self.source.origin}) did not finish rendering within {RENDER_SECONDS:g} s "
          "(a loop or a recursion that long); fix the template"
        ) from None
      except Ended as e:
        self.close_locked()
        raise DataError(f"{where}: the chat template ({self.source.origin}) ended its renderer process ({e}); fix the template") from None
    if answer.get("error") == NOT_PREFIX:
      raise DataError(
        f"{where}: the chat template ({self.source.origin}) does not render conversations prefix by prefix; use a template whose output only grows turn by turn"
      )
    if "error" in answer:
      raise DataError(f"{where}: the chat template ({self.source.origin}) failed: {answer['error']}; fix the template or the record")
    return [(text, bool(trainable)) for text, trainable in answer["pieces"]]

  def close(self) -> None:
    """Stop the renderer process (a later render starts another)."""
    with self._lock:
      self.close_locked()

  def close_locked(self) -> None:
    if self._proc is not None and self._owner == os.getpid():
      _stop(self._proc, self._owner)
    self._proc = None
    self._buffer = bytearray()

  def _start(self) -> None:
    """Start the renderer and compile the template there; any failure is a ConfigError naming the template."""
    name = self.source.origin
    try:
      proc = subprocess.Popen(
        [sys.executable, str(WORKER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C at the terminal reaches the trainer (which stops gracefully), not the renderer
      )
    except OSError as e:
      raise ConfigError(f"cannot start the chat template renderer for the chat template ({name}): {e}; check the Python installation") from None
    self._proc, self._owner, self._buffer = proc, os.getpid(), bytearray()
    weakref.finalize(self, _stop, proc, self._owner)
    setup = {"source": self.source.text, "max_chars": MAX_RENDER_CHARS, "max_bytes": MAX_RENDER_BYTES}
    try:
      self._wait_ready()
      answer = self._ask((json.dumps(setup) + "\n").encode(), RENDER_SECONDS)
    except Late:
      self.close_locked()
      raise ConfigError(f"the chat template ({name}) did not compile within {RENDER_SECONDS:g} s; fix the template") from None
    except Ended as e:
      self.close_locked()
      raise ConfigError(f"the chat template ({name}) ended its renderer process while compiling ({e}); fix the template") from None
    if "error" in answer:
      self.close_locked()
      if answer.get("line") is not None:
        raise ConfigError(f"the chat template ({name}) has a syntax error at line {answer['line']}: {answer['error']}; fix the template")
      raise ConfigError(f"the chat template ({name}) cannot be compiled: {answer['error']}; fix the template")

  def _wait_ready(self) -> None:
    try:
      answer = self._read(time.monotonic() + START_SECONDS)
    except Late:
      self.close_locked()
      raise ConfigError(f"the chat template renderer did not start within {START_SECONDS:g} s; retry on a less busy host") from None
    except Ended as e:
      self.close_locked()
      raise ConfigError(f"the chat template renderer did not start ({e}); check that jinja2 is installed") from None
    if not answer.get("ready"):
      raise ConfigError("the chat template renderer did not start; check that jinja2 is installed")

  def _ask(self, request: bytes, seconds: float) -> dict[str, Any]:
    assert self._proc is not None and self._proc.stdin is not None
    try:
      self._proc.stdin.write(request)
      self._proc.stdin.flush()
    except OSError:
      raise Ended(self._how_it_ended()) from None
    return self._read(time.monotonic() + seconds)

  def _read(self, deadline: float) -> dict[str, Any]:
    """One JSON line from the renderer, by the deadline."""
    assert self._proc is not None and self._proc.stdout is not None
    fd = self._proc.stdout.fileno()
    while b"\n" not in self._buffer:
      left = deadline - time.monotonic()
      if left <= 0:
        raise Late()
      ready, _, _ = select.select([fd], [], [], left)
      if ready:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
          raise Ended(self._how_it_ended())
        self._buffer += chunk
    line, _, rest = bytes(self._buffer).partition(b"\n")
    self._buffer = bytearray(rest)
    return json.loads(line)

  def _how_it_ended(self) -> str:
    assert self._proc is not None
    try:
      code = self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      return "it stopped answering"
    if code < 0:
      name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
      return f"killed by {name}" + (", likely out of memory" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


def _stop(proc: subprocess.Popen, owner: int) -> None:
  """End a renderer process started by this process (a forked copy leaves its parent's alone)."""
  if owner != os.getpid() or proc.poll() is not None:
    return
  proc.kill()
  proc.wait()
  for stream in (proc.stdin, proc.stdout):
    if stream is not None:
      try:
        stream.close()
      except OSError:
        pass
