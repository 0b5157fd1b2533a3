"""Keep large host buffers mapped between steps when training on CPU (glibc malloc tuning).

XLA:CPU allocates each execution's temporary buffer (the size of the step's temporaries) with
`posix_memalign` from a worker thread. glibc serves that from a per-thread arena, which cannot
hold it, so every step maps fresh pages and unmaps them afterwards: page faults and zero-filling
for the whole buffer every step (figures: benchmarks/README.md, figures behind code comments). Three `mallopt` settings stop that: one arena (the main heap, which can
grow), no mmap for large blocks, and no trimming of freed memory, so the pages are reused.

They must be set before JAX creates its thread pool (`maxtext.process.prepare` does it before counting
devices), and only for CPU runs: accelerator hosts keep glibc's defaults.
"""

from __future__ import annotations

import ctypes

from maxtext import platform
from maxtext.config import MaxTextConfig

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def runs_on_cpu(config: MaxTextConfig, platforms: str | None = None, accelerator_nodes: bool | None = None) -> bool:
  """Whether JAX will pick the CPU backend, decided without initialising it (maxtext.platform.predict)."""
  return platform.predict(config, platforms, accelerator_nodes) == "cpu"


def keep_buffers_mapped() -> bool:
  """Apply the mallopt settings; False where the C library has no mallopt (not glibc)."""
  mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
  if mallopt is None:
    return False
  settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
  return all(mallopt(option, value) == 1 for option, value in settings)


def tune(config: MaxTextConfig) -> bool:
  """keep_buffers_mapped() where the predicted platform's policy asks for it (CPU); returns whether it was applied."""
  return platform.for_platform(config, platform.predict(config)).tune_host_allocator and keep_buffers_mapped()
