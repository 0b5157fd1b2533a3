"""Output locations: check they are writable and roomy before a run writes, and name the path when a write fails.

`check_writable(path, bytes_needed)` runs before anything is created. `as_user_error(e, path, bytes_needed)`
turns a full, read-only or misplaced output met mid-run (an OSError, or the same cause as text in an
Orbax/TensorStore error) into a one-line OutputError.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

from maxtext.errors import UserError, gib

FULL = {errno.ENOSPC: "is full", errno.EDQUOT: "is over its disk quota"}
NOT_WRITABLE = {errno.EROFS: "is read-only", errno.EACCES: "is not writable (permission denied)", errno.EPERM: "is not writable (operation not permitted)"}
MISPLACED = {
  errno.ENOTDIR: "lies under a regular file, not a directory",
  errno.EEXIST: "is a regular file where a directory is needed",
  errno.ENOENT: "cannot be created (this file system refuses it, or a directory on its path vanished)",
}
TEXTS = {
  "no space left on device": "is full",
  "disk quota exceeded": "is over its disk quota",
  "read-only file system": "is read-only",
  "permission denied": "is not writable (permission denied)",
  "not a directory": "lies under a regular file, not a directory",
}


class OutputError(UserError):
  """An output location that is full, read-only or not a directory."""


def is_remote(path: str) -> bool:
  return "://" in path


def _existing_ancestor(path: str) -> str:
  p = os.path.abspath(path)
  while not os.path.lexists(p):
    p = os.path.dirname(p)
  return p


def check_writable(path: str, bytes_needed: int, what: str, is_file: bool = False) -> None:
  """path (a directory, or with is_file a file to append to; created later if missing) can take bytes_needed more
  bytes; else a one-line OutputError. Creates nothing."""
  if is_remote(path):
    return  # object stores: no local check; failures mid-run still end in one line (as_user_error)
  if is_file:
    if os.path.isdir(path):
      raise OutputError(f"{what} {path} is a directory; name a file")
    if os.path.exists(path) and not os.access(path, os.W_OK):
      raise OutputError(f"{what} {path} cannot be written ({'read-only' if _read_only(path) else 'no permission'}); choose a writable location")
    path = os.path.dirname(os.path.abspath(path))
  anchor = _existing_ancestor(path)
  if not os.path.isdir(anchor):
    raise OutputError(f"{what} {path} lies under {anchor}, which is not a directory; choose another location")
  if not os.access(anchor, os.W_OK | os.X_OK):
    reason = "is read-only" if _read_only(anchor) else "is not writable"
    raise OutputError(f"{what} {path} cannot be written: {anchor} {reason}; choose a writable location (needs {gib(bytes_needed)})")
  free = shutil.disk_usage(anchor).free
  if free < bytes_needed:
    raise OutputError(f"{what} {path} needs {gib(bytes_needed)} but {anchor} has {gib(free)} free; free space or choose another location")


def check_new_directory(path: str, what: str) -> None:
  """path can become a new output directory: absent (or an empty directory) under a writable directory; else a
  one-line OutputError. Creates nothing."""
  if os.path.lexists(path) and not os.path.isdir(path):
    raise OutputError(f"{what} '{path}' is an existing file, not a directory; name a new directory")
  if os.path.isdir(path) and os.listdir(path):
    raise OutputError(f"{what} '{path}' already exists and is not empty; name a new directory (nothing was overwritten)")
  check_writable(path, 0, what)


def check_can_make(path: str, what: str) -> None:
  """A directory can be made where path will be (permissions do not tell for root, nor for a special file system such
  as /proc): one is made there and removed, else a one-line OutputError. Call it right before writing path."""
  if is_remote(path):
    return
  anchor = _existing_ancestor(path)
  try:
    os.rmdir(tempfile.mkdtemp(prefix=".maxtext-probe-", dir=anchor))
  except OSError as e:
    raise OutputError(f"{what} '{path}' cannot be made: creating a directory in {anchor} fails ({e.strerror}); choose a writable location") from None


def _read_only(path: str) -> bool:
  try:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
  except OSError:
    return False


def _reason(e: BaseException) -> str | None:
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno is not None:
      for table in (FULL, NOT_WRITABLE, MISPLACED):
        if e.errno in table:
          return table[e.errno]
    text = str(e).lower()
    for phrase, reason in TEXTS.items():
      if phrase in text:
        return reason
    e = e.__cause__ or e.__context__
  return None


RERUN = "Earlier checkpoints are intact; free space or fix the location, then rerun the same command to continue"


def as_user_error(e: BaseException, path: str, bytes_needed: int, what: str, advice: str = RERUN) -> OutputError | None:
  """An OutputError naming path (and the bytes a save needs, when known) when e is a full/read-only/misplaced output; else None."""
  if isinstance(e, UserError):
    return None
  reason = _reason(e)
  if reason is None:
    return None
  where = getattr(e, "filename", None) or path
  needs = f"; it needs {gib(bytes_needed)} free" if bytes_needed else ""
  return OutputError(f"writing {what} failed: {where} {reason}{needs}. {advice}")
