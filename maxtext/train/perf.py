"""Device peak throughput (for MFU): config value, else the chip table, else measured once per host and cached.

Accelerators use the chip's published peak (`PEAK_BF16_TFLOPS`). Without a table entry (CPUs), the yardstick is
the best rate of a bf16 matmul (at least 30 repeats over at least 1.5 s, so one quiet moment on a shared host
suffices), measured the first time a run needs it on a host and kept in a cache file (`cache_path()`), so MFU
compares between runs on the host. The measured figure is a lower bound on the device's peak: when a train step
runs faster than it, that step's rate becomes the yardstick and the cache (`Yardstick.mfu`). A measured MFU is
therefore never above 100%. `device_peak_tflops` overrides table and cache alike.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import time

import jax
import jax.numpy as jnp

from maxtext import platform
from maxtext.config import MaxTextConfig

# device_kind substring (lower case) -> peak dense bf16 TFLOP/s per device (REFERENCES.md).
PEAK_BF16_TFLOPS = (
  ("v6 lite", 918.0),
  ("v6e", 918.0),
  ("v5 lite", 197.0),
  ("v5e", 197.0),
  ("v5p", 459.0),
  ("tpu v5", 459.0),
  ("tpu v4", 275.0),
  ("h200", 989.0),
  ("h100", 989.0),
  ("a100", 312.0),
)

MEASURED = "measured bf16 matmul, best of 1.5 s"


def table_peak_tflops(device_kind: str) -> float | None:
  kind = device_kind.lower()
  return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in kind), None)


def matmul_size() -> int:
  """The matmul the yardstick times: [n, n] @ [n, n] with n 1024 on CPU, 8192 on accelerators."""
  return 1024 if platform.local_platform() == "cpu" else 8192


def measure_matmul_tflops(n: int = 0) -> float:
  """bf16 [n, n] @ [n, n] throughput (float32 accumulation) of one device in TFLOP/s, measured once per process and size
  (n = 0: `matmul_size()`)."""
  return _measure(n or matmul_size())


@functools.cache
def _measure(n: int, min_repeats: int = 30, min_seconds: float = 1.5) -> float:
  """Best of at least min_repeats timed matmuls spanning at least min_seconds (the most favourable figure)."""
  a = jnp.ones((n, n), jnp.bfloat16)  # on the default device
  b = jnp.full((n, n), 0.5, jnp.bfloat16)
  # float32 accumulation, as the model's matmuls (maxtext.layers.matmul); on XLA:CPU a bf16-output matmul
  # takes a float32 upcast path, far slower than the machine's bf16 units (benchmarks/README.md, figures behind code comments).
  matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  matmul(a, b).block_until_ready()
  best, spent, repeats = float("inf"), 0.0, 0
  while repeats < min_repeats or spent < min_seconds:
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    elapsed = time.perf_counter() - start
    best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
  return 2 * n**3 / best / 1e12


def cache_path() -> str:
  """Where measured yardsticks are kept: $XDG_CACHE_HOME/maxtext (default ~/.cache/maxtext)/peak_tflops.json."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "maxtext", "peak_tflops.json")


def cache_key() -> str:
  """The host, the device kind, the matmul size and the JAX version: what the measured rate depends on."""
  return f"{socket.gethostname()} {platform.device_kind()} n={matmul_size()} jax {jax.__version__}"


def _read_cache(path: str) -> dict[str, float]:
  try:
    with open(path) as f:
      table = json.load(f)
    return {k: float(v) for k, v in table.items()} if isinstance(table, dict) else {}
  except (OSError, ValueError, TypeError):
    return {}  # no cache yet, or one this version cannot read: measure again


def _write_cache(path: str, key: str, tflops: float) -> None:
  """Record tflops under key (atomically); a cache that cannot be written costs only a measurement next time."""
  table = _read_cache(path)
  table[key] = tflops
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(table, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
  except OSError:
    pass


def cached_matmul_tflops(path: str | None = None) -> tuple[float, bool]:
  """(this host's yardstick, whether it came from the cache): measured and cached on first use."""
  path = path or cache_path()
  key = cache_key()
  cached = _read_cache(path).get(key)
  if cached and cached > 0:
    return cached, True
  tflops = measure_matmul_tflops()
  _write_cache(path, key, tflops)
  return tflops, False


def peak_tflops(config: MaxTextConfig) -> tuple[float, str]:
  """(peak bf16 TFLOP/s per device, where the figure comes from)."""
  if config.device_peak_tflops > 0:
    return config.device_peak_tflops, "config"
  table = table_peak_tflops(platform.device_kind())
  if table is not None:
    return table, "chip table"
  tflops, cached = cached_matmul_tflops()
  return tflops, f"{MEASURED}, {'from this host' if cached else 'now'}"


@dataclasses.dataclass
class Yardstick:
  """The peak TFLOP/s per device that MFU divides by, and where it comes from."""

  tflops: float
  source: str
  measured: bool = False  # a measured figure is a lower bound on the peak, raised by any faster step
  cache: str = ""  # the cache file of a measured figure, updated when a step raises it

  @classmethod
  def of(cls, config: MaxTextConfig) -> Yardstick:
    tflops, source = peak_tflops(config)
    measured = source.startswith(MEASURED)
    return cls(tflops, source, measured=measured, cache=cache_path() if measured else "")

  def described(self) -> str:
    """The source, with the cache file and the key that overrides it for a measured figure (the banner's words)."""
    return f"{self.source}; cached in {self.cache}, device_peak_tflops=X overrides" if self.cache else self.source

  def mfu(self, achieved_tflops: float) -> float:
    """achieved / peak; a step faster than a measured peak becomes the peak (the device just showed it can)."""
    if self.measured and achieved_tflops > self.tflops:
      self.tflops, self.source = achieved_tflops, "fastest train step so far"
      if self.cache:
        _write_cache(self.cache, cache_key(), achieved_tflops)
    return achieved_tflops / self.tflops if self.tflops > 0 else 0.0
