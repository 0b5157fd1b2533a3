"""User-facing errors: one line naming the cause and the fix, exit code 2."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C
EXIT_GRACE_SECONDS = 10.0  # after an error, the most the interpreter's shutdown may take before the process ends anyway

F = TypeVar("F", bound=Callable[..., object])


class UserError(Exception):
  """An error the user can cause and fix (config, paths, data). Its message is one line."""

  exit_code = EXIT_USER_ERROR


class ConfigError(UserError):
  """An invalid configuration."""


class DataError(UserError):
  """Missing, unreadable or malformed input data."""


def shorten(names: list[str], limit: int = 5) -> str:
  """'a, b, c and 4 more': a list short enough for a one-line message."""
  more = len(names) - limit
  return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def gib(n: float) -> str:
  """A size for messages: '1.50 GiB (1610612736 bytes)', '338 KiB (345992 bytes)'."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit} ({int(n)} bytes)" if unit == "GiB" else f"{n / scale:.0f} {unit} ({int(n)} bytes)"
  return f"{int(n)} bytes"


ECHO_CHARS = 200  # the most of a user's value an error message repeats
LINE_CHARS = 2000  # the most an error line may hold at all


def echo(value: object, limit: int = ECHO_CHARS) -> str:
  """repr(value) for an error message, cut to about `limit` characters: "'aaaa...' (52428800 characters)"."""
  text = repr(value)
  return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def one_line(message: str) -> str:
  """message on one line, at most LINE_CHARS long (a value a message repeats in full is cut)."""
  line = " ".join(str(message).split())
  return line if len(line) <= LINE_CHARS else f"{line[:LINE_CHARS]}... (cut: {len(line)} characters)"


def quiet_libraries() -> None:
  """Keep library chatter off the user's terminal: absl warnings (Orbax), 'Event loop is closed' left by a failed
  checkpoint read, and the resource tracker's 'leaked shared_memory' warnings after grain worker processes stop
  (the tracker process reads sys.warnoptions)."""
  try:
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.FATAL)  # Orbax logs failures it raises; the error line (or traceback) carries them
  except ImportError:
    pass
  if not getattr(sys.unraisablehook, "maxtext_quiet", False):
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)
  quiet_tracker = "ignore:resource_tracker:UserWarning"
  if quiet_tracker not in sys.warnoptions:
    sys.warnoptions.append(quiet_tracker)


# What a failed Orbax restore leaves behind, after the failure itself was raised (and reported or acted on): when one
# array of a damaged checkpoint fails to read, Orbax abandons the sibling reads; closing those coroutines makes each
# raise "Encountered error while reading array index" (Orbax catches BaseException, GeneratorExit included), and
# TensorStore callbacks then find the event loop closed. Nothing of ours is left unawaited.
ABANDONED_READ_NOISE = ("Event loop is closed", "Encountered error while reading array index")


def _quiet_unraisable(previous: Callable) -> Callable:
  """Drop the noise of a failed Orbax/TensorStore read (ABANDONED_READ_NOISE); report the rest."""

  def hook(unraisable) -> None:
    if any(text in str(unraisable.exc_value) for text in ABANDONED_READ_NOISE):
      return
    previous(unraisable)

  hook.maxtext_quiet = True  # type: ignore[attr-defined]
  return hook


def exit_within(seconds: float, code: int) -> None:
  """End the process with `code` if it is still running `seconds` from now: after a failure, a library's background
  thread (e.g. Orbax waiting for a directory that was never made) must not keep the interpreter from exiting."""
  timer = threading.Timer(seconds, os._exit, (code,))
  timer.daemon = True
  timer.start()


INTERRUPTED_LINE = "error: interrupted by Ctrl-C; stopped at once (finished checkpoints and outputs are intact); rerun the same command to continue"


def end_interrupted() -> None:
  """Print the Ctrl-C line and end the process now with exit 130. Not sys.exit: shutdown would wait for background
  writers, and a further Ctrl-C there prints a traceback."""
  with contextlib.suppress(Exception):  # stdout may already be closed
    print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
    sys.stdout.flush()
  os._exit(EXIT_INTERRUPTED)


def runs_as_program(fn: Callable) -> bool:
  """Whether fn belongs to the module Python runs as the program (`python -m maxtext.train`): the process then ends
  when fn returns. Called from another program (a test, a notebook), it must not end that process."""
  return getattr(fn, "__module__", None) == "__main__"


def cli_main(fn: F) -> F:
  """Wrap an entry point: a UserError prints `error: ...` on stderr and exits with its code, a KeyboardInterrupt one line
  and exit 130; library warnings are muted. Run as the program, the process also ends within EXIT_GRACE_SECONDS of an
  error, and at once on the Ctrl-C, whatever library threads are left."""
  program = runs_as_program(fn)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    quiet_libraries()
    try:
      return fn(*args, **kwargs)
    except UserError as e:
      print(f"error: {one_line(str(e))}", file=sys.stderr, flush=True)
      if program:
        exit_within(EXIT_GRACE_SECONDS, e.exit_code)
      sys.exit(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C where nothing waits for it, or a second Ctrl-C during training: stop at once
      if program:
        end_interrupted()
      print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
      sys.exit(EXIT_INTERRUPTED)
    except Exception:  # a bug: Python prints the traceback; the process still ends
      if program:
        exit_within(EXIT_GRACE_SECONDS, 1)
      raise

  return wrapper  # type: ignore[return-value]
