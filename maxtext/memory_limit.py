"""The memory this process may use, and XLA's out-of-memory errors as one line.

On CPU the limit is the smallest of what is left under: the host's available memory (`MemAvailable`), the
cgroup's limit (`memory.max`, or `memory.limit_in_bytes` under cgroup v1; each level up to the root), and the
process's own limits RLIMIT_AS (`ulimit -v`, which counts the address space already mapped) and RLIMIT_DATA (which
counts its data segments). Containers and batch schedulers limit memory in these ways. On GPU and TPU it is the
device allocator's limit. `limit_per_device()` names the limit it used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

from maxtext.errors import UserError, gib

EXIT_OUT_OF_MEMORY = 1
UNLIMITED = 1 << 62  # cgroup v1 writes 'no limit' as a number near 2**63
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclasses.dataclass(frozen=True)
class Limit:
  bytes: int  # what may still be allocated
  what: str  # where the figure comes from, for messages


def _status_bytes(field: str) -> int:
  """A 'VmSize:'-style field of /proc/self/status in bytes (0 when unknown)."""
  try:
    for line in Path("/proc/self/status").read_text().splitlines():
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return 0


def _read_int(path: Path) -> int | None:
  try:
    text = path.read_text().strip()
  except OSError:
    return None
  return int(text) if text.isdigit() else None  # 'max' (cgroup v2 without a limit) -> None


def _stat_value(path: Path, key: str) -> int:
  try:
    for line in path.read_text().splitlines():
      name, _, value = line.partition(" ")
      if name == key:
        return int(value)
  except (OSError, ValueError):
    pass
  return 0


def _cgroup_dirs(membership: Path, root: Path) -> list[tuple[Path, str, str, str]]:
  """(directory, limit file, usage file, reclaimable key of memory.stat) for the memory cgroup that `membership`
  (/proc/self/cgroup) names under `root`, and each of its parents."""
  try:
    entries = membership.read_text().splitlines()
  except OSError:
    return []
  out = []
  for entry in entries:
    hierarchy, controllers, path = (entry.split(":", 2) + ["", ""])[:3]
    if hierarchy == "0" and controllers == "":  # cgroup v2
      base, files = root, ("memory.max", "memory.current", "inactive_file")
    elif "memory" in controllers.split(","):  # cgroup v1
      base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    else:
      continue
    d = base / path.lstrip("/")
    while True:
      out.append((d, *files))
      if d == base or base not in d.parents:
        break
      d = d.parent
  return out


def host_limits(membership: Path = Path("/proc/self/cgroup"), cgroup_root: Path = CGROUP_ROOT) -> list[Limit]:
  """Every limit on this process's memory that applies (at least the host's available memory)."""
  limits = [Limit(_meminfo_available(), "the host's available memory (MemAvailable)")]
  for d, limit_file, usage_file, reclaimable in _cgroup_dirs(membership, cgroup_root):
    limit = _read_int(d / limit_file)
    if limit is None or limit >= UNLIMITED:
      continue
    usage = _read_int(d / usage_file) or 0
    free = limit - usage + _stat_value(d / "memory.stat", reclaimable)
    limits.append(Limit(max(0, min(free, limit)), f"the cgroup memory limit {gib(limit)} ({d / limit_file})"))
  for name, rlimit, used_field, shell in (
    ("RLIMIT_AS", resource.RLIMIT_AS, "VmSize", "ulimit -v"),
    ("RLIMIT_DATA", resource.RLIMIT_DATA, "VmData", "ulimit -d"),
  ):
    soft = resource.getrlimit(rlimit)[0]
    if soft != resource.RLIM_INFINITY:
      used = _status_bytes(used_field)
      limits.append(Limit(max(0, soft - used), f"{name} ({shell}) of {gib(soft)} less the {gib(used)} already mapped"))
  return limits


def _meminfo_available() -> int:
  try:
    for line in Path("/proc/meminfo").read_text().splitlines():
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def limit_per_device(devices: list | None = None) -> Limit:
  """What one device may use: the accelerator allocator's limit, or on CPU the smallest host limit shared by the local devices."""
  import jax

  devices = devices or jax.local_devices()
  mine = [d for d in devices if d.process_index == jax.process_index()] or jax.local_devices()
  device = mine[0]  # another process's device has no memory_stats here
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return Limit(int(stats["bytes_limit"]), f"{device.device_kind} memory")
  local = len(mine)
  tightest = min(host_limits(), key=lambda limit: limit.bytes)
  shared = f", shared by {local} CPU devices" if local > 1 else ""
  return Limit(tightest.bytes // max(1, local), f"{tightest.what}{shared}")


class OutOfMemory(UserError):
  """XLA (or the host) could not allocate what a run asked for, after the checks: one line, exit 1."""

  exit_code = EXIT_OUT_OF_MEMORY


# TensorStore reports a full disk as RESOURCE_EXHAUSTED too ("Failed to write N bytes to file 7: No space left on
# device"): that is a full output (maxtext.train.outputs), not memory.
DISK_FULL_TEXTS = ("no space left on device", "disk quota exceeded")


def is_out_of_memory(error: BaseException) -> bool:
  text = str(error)
  if any(t in text.lower() for t in DISK_FULL_TEXTS):
    return False
  return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "Out of memory" in text


_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def asked_bytes(error: BaseException) -> int | None:
  """The allocation an out-of-memory error names: 'allocating 19626823392 bytes' (CPU), 'allocate 1234 bytes' (GPU),
  'Attempting to allocate 12.34G' (TPU), 'Used 120.5G of 95.74G hbm' (TPU compile)."""
  text = str(error)
  m = re.search(r"allocat\w*\s+(\d+)\s*bytes", text)
  if m:
    return int(m.group(1))
  m = re.search(r"(?:allocate|reserve|Used)\s+([\d.]+)\s*([KMGT]?)i?B?\b", text)
  return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def out_of_memory(error: BaseException, where: str, remedy: str) -> OutOfMemory | None:
  """The one-line OutOfMemory for an out-of-memory error met `where` (e.g. 'in the first train step'), else None.

  remedy: the keys that lower memory, as a clause ('lower per_device_batch_size (4) or ...')."""
  if isinstance(error, UserError) or not is_out_of_memory(error):
    return None
  limit = limit_per_device()
  asked = asked_bytes(error)
  what = f"it asked for {gib(asked)}" if asked else "an allocation failed"
  return OutOfMemory(f"out of memory {where}: {what}, and {limit.what} leaves {gib(limit.bytes)} per device; {remedy}")


@contextlib.contextmanager
def one_line(where: str | Callable[[], str], remedy: str) -> Iterator[None]:
  """Turn an out-of-memory error raised in the block into OutOfMemory (where: a phrase, or a function giving one)."""
  try:
    yield
  except Exception as e:
    error = out_of_memory(e, where() if callable(where) else where, remedy)
    if error is None:
      raise
    raise error from None
