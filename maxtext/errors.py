"""User-facing errors: one line naming the cause and the fix, exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

EXIT_USER_ERROR = 2

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


def one_line(message: str) -> str:
  return " ".join(str(message).split())


def cli_main(fn: F) -> F:
  """Wrap an entry point: a UserError prints `error: ...` on stderr and exits with its code."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except UserError as e:
      print(f"error: {one_line(str(e))}", file=sys.stderr, flush=True)
      sys.exit(e.exit_code)

  return wrapper  # type: ignore[return-value]
