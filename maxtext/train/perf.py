"""Device peak throughput (for MFU): config value, else the chip table, else measured on the host and cached.

Accelerators use the chip's published peak (`PEAK_BF16_TFLOPS`). Without a table entry (CPUs), the yardstick is
the best rate of a bf16 matmul (at least 30 repeats over at least 1.5 s), measured the first time a run needs it on
a host and kept in a cache file (`cache_path()`), so MFU compares between runs on the host. The cache keeps the
best figure ever seen: a measurement taken while the host was busy is too low, and would inflate every later MFU.
So when a step of a run reaches STALE_MFU of the yardstick, the matmul is measured again (once per run) and the
faster figure kept, and a step faster than even that becomes the yardstick itself (`Yardstick.mfu`); each raise is
said in the log (`Yardstick.take_note`). A measured MFU is therefore never above 100%, and one near 100% has been
checked against a fresh measurement. `device_peak_tflops` overrides table and cache alike.

With `quantization` the peak is that of the format its products run in (`matmul_format`): int8 TOP/s for int8
(`PEAK_INT8_TOPS`; on CPUs a measured int8 matmul, or the bf16 one when faster), fp8 TFLOP/s for fp8/fp8_full where
the chip has fp8 units (`PEAK_FP8_TFLOPS`; elsewhere XLA converts fp8 to bf16 and the bf16 peak applies), bf16 for
int4w (its weights are dequantized into bf16 products). A chip without a known int8 figure is measured against its
bf16 peak, and the yardstick's source says so. Attention and the output head run in bf16 in every mode.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import time
from collections.abc import Callable

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

# device_kind substring -> peak dense int8 TOP/s and fp8 TFLOP/s per device (vendor datasheets; TPU v4 runs int8 at its bf16 rate).
PEAK_INT8_TOPS = (
  ("v6 lite", 1836.0),
  ("v6e", 1836.0),
  ("v5 lite", 394.0),
  ("v5e", 394.0),
  ("v5p", 918.0),
  ("tpu v5", 918.0),
  ("tpu v4", 275.0),
  ("h200", 1979.0),
  ("h100", 1979.0),
  ("a100", 624.0),
)
PEAK_FP8_TFLOPS = (("h200", 1979.0), ("h100", 1979.0))

# device_kind substring -> peak HBM bandwidth in GB/s per device (vendor datasheets), the weight-streaming bound of
# decoding. First match wins: the PCIe H100 (HBM2e) before the SXM part (HBM3).
PEAK_HBM_GB_PER_S = (
  ("v6 lite", 1640.0),
  ("v6e", 1640.0),
  ("v5 lite", 819.0),
  ("v5e", 819.0),
  ("v5p", 2765.0),
  ("tpu v5", 2765.0),
  ("tpu v4", 1228.0),
  ("h200", 4800.0),
  ("h100 pcie", 2000.0),
  ("h100", 3350.0),
  ("a100-sxm4-40gb", 1555.0),
  ("a100", 2039.0),
)

MEASURED = "measured bf16 matmul, best of 1.5 s"
STEP_SOURCE = "fastest train step so far"
STALE_MFU = 0.9  # a step at this share of a measured yardstick has the matmul measured again: the cached figure may be low
MEASURED_INT8 = "measured int8 matmul (int32 accumulation), best of 1.5 s"


def table_peak_tflops(device_kind: str, table: tuple[tuple[str, float], ...] = PEAK_BF16_TFLOPS) -> float | None:
  kind = device_kind.lower()
  return next((tflops for key, tflops in table if key in kind), None)


def hbm_gb_per_s(device_kind: str) -> float | None:
  """The device's peak HBM bandwidth in GB/s from the datasheet table (None for CPUs and unknown chips)."""
  return table_peak_tflops(device_kind, PEAK_HBM_GB_PER_S)


def matmul_format(config: MaxTextConfig) -> str:
  """The number format the run's quantized products use: 'int8', 'fp8' or 'bf16'."""
  return {"int8": "int8", "fp8": "fp8", "fp8_full": "fp8"}.get(config.quantization, "bf16")


def matmul_size() -> int:
  """The matmul the yardstick times: [n, n] @ [n, n] with n 1024 on CPU, 8192 on accelerators."""
  return 1024 if platform.local_platform() == "cpu" else 8192


def measure_matmul_tflops(n: int = 0, fmt: str = "bf16") -> float:
  """[n, n] @ [n, n] throughput of one device in TFLOP/s (TOP/s for int8), measured once per process, size and format:
  bf16 with float32 accumulation, or int8 with int32 accumulation (n = 0: `matmul_size()`)."""
  return _measure(n or matmul_size(), fmt)


@functools.cache
def _measure(n: int, fmt: str = "bf16", min_repeats: int = 30, min_seconds: float = 1.5) -> float:
  """Best of at least min_repeats timed matmuls spanning at least min_seconds (the most favourable figure)."""
  dt, acc = (jnp.int8, jnp.int32) if fmt == "int8" else (jnp.bfloat16, jnp.float32)
  a = jnp.ones((n, n), dt)  # on the default device
  b = jnp.full((n, n), 3 if fmt == "int8" else 0.5, dt)
  # float32 accumulation, as the model's matmuls (maxtext.layers.matmul); on XLA:CPU a bf16-output matmul
  # takes a float32 upcast path, far slower than the machine's bf16 units (benchmarks/README.md, figures behind code comments).
  matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=acc))
  matmul(a, b).block_until_ready()
  best, spent, repeats = float("inf"), 0.0, 0
  while repeats < min_repeats or spent < min_seconds:
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    elapsed = time.perf_counter() - start
    best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
  return 2 * n**3 / best / 1e12


def fresh_matmul_tflops(fmt: str = "bf16") -> float:
  """A new measurement of measure_matmul_tflops (not the one this process may already have taken)."""
  return _measure.__wrapped__(matmul_size(), fmt)


def cache_path() -> str:
  """Where measured yardsticks are kept: $XDG_CACHE_HOME/maxtext (default ~/.cache/maxtext)/peak_tflops.json."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "maxtext", "peak_tflops.json")


def cache_key(fmt: str = "bf16") -> str:
  """The host, the device kind, the matmul size, the JAX version and the format (int8 apart): what the measured rate depends on."""
  return f"{socket.gethostname()} {platform.device_kind()} n={matmul_size()} jax {jax.__version__}" + ("" if fmt == "bf16" else f" {fmt}")


def _read_cache(path: str) -> dict[str, float]:
  try:
    with open(path) as f:
      table = json.load(f)
    return {k: float(v) for k, v in table.items()} if isinstance(table, dict) else {}
  except (OSError, ValueError, TypeError):
    return {}  # no cache yet, or one this version cannot read: measure again


def _write_cache(path: str, key: str, tflops: float) -> None:
  """Record tflops under key unless the cache holds a higher figure (the best seen is kept), atomically; a cache that
  cannot be written costs only a measurement next time."""
  table = _read_cache(path)
  if table.get(key, 0.0) >= tflops:
    return
  table[key] = tflops
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(table, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
  except OSError:
    pass


def cached_matmul_tflops(path: str | None = None, fmt: str = "bf16") -> tuple[float, bool]:
  """(this host's yardstick in fmt, whether it came from the cache): measured and cached on first use."""
  path = path or cache_path()
  key = cache_key(fmt)
  cached = _read_cache(path).get(key)
  if cached and cached > 0:
    return cached, True
  tflops = measure_matmul_tflops(fmt=fmt)
  _write_cache(path, key, tflops)
  return tflops, False


def peak_tflops(config: MaxTextConfig) -> tuple[float, str]:
  """(peak TFLOP/s per device in the run's matmul format, where the figure comes from)."""
  if config.device_peak_tflops > 0:
    return config.device_peak_tflops, "config"
  kind, fmt = platform.device_kind(), matmul_format(config)
  bf16 = table_peak_tflops(kind)
  if bf16 is None:  # CPUs: measured
    tflops, cached = cached_matmul_tflops()
    when = "from this host" if cached else "now"
    if fmt == "int8":
      int8, _ = cached_matmul_tflops(fmt="int8")
      if int8 >= tflops:
        return int8, f"{MEASURED_INT8}, {when}"
      return tflops, f"{MEASURED}, {when}: faster than this CPU's int8 matmul ({int8:.3f} TOP/s)"
    return tflops, f"{MEASURED}, {when}" + ("; fp8 products run as float on this CPU" if fmt == "fp8" else "")
  if fmt == "int8":
    int8 = table_peak_tflops(kind, PEAK_INT8_TOPS)
    return (int8, "chip table, int8") if int8 else (bf16, f"chip table, bf16: no int8 peak is known for {kind}")
  if fmt == "fp8":
    fp8 = table_peak_tflops(kind, PEAK_FP8_TFLOPS)
    return (fp8, "chip table, fp8") if fp8 else (bf16, f"chip table, bf16: {kind} has no fp8 units, XLA runs fp8 products in bf16")
  return bf16, "chip table"


@dataclasses.dataclass
class Yardstick:
  """The peak TFLOP/s per device that MFU divides by, and where it comes from."""

  tflops: float
  source: str
  measured: bool = False  # a measured figure is a lower bound on the peak, raised by any faster step
  cache: str = ""  # the cache file of a measured figure, updated when a step raises it
  key: str = ""  # its key in the cache (the format measured)
  remeasure: Callable[[], float] | None = None  # a fresh measurement, taken once when a step reaches STALE_MFU of tflops
  remeasured: bool = False
  notes: list[str] = dataclasses.field(default_factory=list)  # raises of the yardstick not yet logged

  @classmethod
  def of(cls, config: MaxTextConfig) -> Yardstick:
    tflops, source = peak_tflops(config)
    if not source.startswith("measured"):
      return cls(tflops, source)
    fmt = "int8" if source.startswith(MEASURED_INT8) else "bf16"
    return cls(tflops, source, measured=True, cache=cache_path(), key=cache_key(fmt), remeasure=lambda: fresh_matmul_tflops(fmt))

  def described(self) -> str:
    """The source, with the cache file and the key that overrides it for a measured figure (the banner's words)."""
    return f"{self.source}; cached in {self.cache}, device_peak_tflops=X overrides" if self.cache else self.source

  def mfu(self, achieved_tflops: float) -> float:
    """achieved / peak, at most 1 for a measured peak. A step at STALE_MFU of it has the matmul measured again (once)
    and the faster figure kept; a step faster than the peak becomes the peak (the device just showed it can)."""
    if self.measured and self.remeasure is not None and not self.remeasured and achieved_tflops >= STALE_MFU * self.tflops:
      self.remeasured = True
      fresh = self.remeasure()
      if fresh > self.tflops:
        self._raise(
          fresh,
          f"{self.source.split(',')[0]}, re-measured",
          f"a step ran at {100 * achieved_tflops / self.tflops:.0f}% of it, so the matmul was measured again",
        )
    if self.measured and achieved_tflops > self.tflops:
      self._raise(achieved_tflops, STEP_SOURCE, "a train step ran faster than it", said=self.source == STEP_SOURCE)
    return achieved_tflops / self.tflops if self.tflops > 0 else 0.0

  def _raise(self, tflops: float, source: str, why: str, said: bool = False) -> None:
    """Raise the yardstick to tflops (and the cache); said: a step raised it before, noted then (not again each step)."""
    where = f" (now in {self.cache})" if self.cache else ""
    if not said:
      self.notes.append(f"MFU yardstick raised from {self.tflops:.3f} to {tflops:.3f} TFLOP/s/device: {why}{where}")
    self.tflops, self.source = tflops, source
    if self.cache:
      _write_cache(self.cache, self.key, tflops)

  def take_note(self) -> str | None:
    """What raised the yardstick since the last call (one line), or None."""
    if not self.notes:
      return None
    note = "; ".join(self.notes)
    self.notes.clear()
    return note
