"""SIGTERM and SIGINT around a training run: the run finishes its step, saves it and exits 0.

`Preemption` is held for the whole of `train()`: a signal is remembered, and the loop stops after the running step
(an eval between batches), saves and returns. A second Ctrl-C stops at once: a process that ends with train()
prints one line and exits 130 from the handler (a KeyboardInterrupt can land in a gc callback, which swallows it);
otherwise it raises KeyboardInterrupt. For a process that ends when train() returns (`python -m maxtext.train`), `ends_process=True`
hands over, on a normal return, to `exit_0_on_signal`: from then until the process is gone (the closing of files,
atexit handlers, the interpreter's shutdown), a signal ends the process at once with exit 0, since its last step is
saved. Late in shutdown Python resets its handlers to the default (which would end the process with 143); the
signals are ignored from the last atexit handler on instead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from typing import Any

from maxtext.errors import end_interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """Remembers a SIGTERM or SIGINT so the run can finish its step, save and exit cleanly."""

  def __init__(self, ends_process: bool = False):
    self.signal_name = ""
    self.ends_process = ends_process
    self._previous: dict[int, Any] = {}

  @property
  def requested(self) -> bool:
    return bool(self.signal_name)

  def __enter__(self) -> Preemption:
    for sig in SIGNALS:
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: no handler
        pass
    return self

  def _handle(self, signum: int, frame: Any) -> None:
    if self.signal_name == "SIGINT" and signum == signal.SIGINT:  # a second Ctrl-C: stop now (finished checkpoints stay intact)
      if self.ends_process:  # end here: a KeyboardInterrupt raised inside a gc callback or a finalizer is swallowed
        end_interrupted()
      raise KeyboardInterrupt
    self.signal_name = self.signal_name or signal.Signals(signum).name

  def __exit__(self, exc_type: Any, *exc: Any) -> None:
    if self.ends_process and exc_type is None and self._previous:
      exit_0_on_signal()
      return
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)


def exit_0_on_signal() -> None:
  """From now until the process is gone, SIGTERM and SIGINT end it at once with exit 0 (its work is saved)."""
  for sig in SIGNALS:
    signal.signal(sig, _exit_0)
  atexit.register(_ignore_signals)  # atexit runs handlers last-registered first: this one before the earlier ones


def _exit_0(signum: int, frame: Any) -> None:
  with contextlib.suppress(Exception):  # stdout may already be closed
    print(f"received {signal.Signals(signum).name} after the run ended (its last step is saved); exiting", flush=True)
    sys.stderr.flush()
  os._exit(0)


def _ignore_signals() -> None:
  for sig in SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
