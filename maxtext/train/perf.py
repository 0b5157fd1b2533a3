"""Device peak throughput (for MFU): config value, else the chip table, else measured once.

The peak is that of the format the quantized products run in (`matmul_format`): int8 for quantization=int8, fp8
for fp8/fp8_full where the chip has fp8 units (elsewhere XLA converts fp8 to bf16 and the bf16 peak applies), bf16
otherwise (int4w dequantizes its weights into bf16 products). A chip without a known int8 figure is measured against
its bf16 peak, and the yardstick's source says so. Attention and the output head run in bf16 in every mode.

Without a table entry (CPUs), the yardstick is the best rate of a bf16 matmul timed once per process (at least
30 repeats over at least 1.5 s, so one quiet moment on a shared host suffices), and it is a lower bound on the
device's peak: when a train step runs faster than it, that step's rate becomes the yardstick (`Yardstick.mfu`).
A measured MFU is therefore the step's share of the fastest matmul throughput this process has seen, never above 100%.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from maxtext import platform
from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError

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

MEASURED = "measured bf16 matmul, best of 1.5 s"
MEASURED_INT8 = "measured int8 matmul (int32 accumulation), best of 1.5 s"

BACKEND_OF_HARDWARE = {"cpu": "cpu", "gpu": "gpu", "gpu_multiprocess": "gpu", "tpu": "tpu"}


def check_hardware(config: MaxTextConfig) -> None:
  """config.hardware (unless 'auto') must name the backend JAX uses."""
  if config.hardware == "auto":
    return
  want, have = BACKEND_OF_HARDWARE[config.hardware], platform.local_platform()
  if want != have:
    raise ConfigError(f"hardware={config.hardware} but JAX runs on '{have}'; set hardware=auto or hardware={have}, or fix the JAX install")


def table_peak_tflops(device: jax.Device, table: tuple[tuple[str, float], ...] = PEAK_BF16_TFLOPS) -> float | None:
  kind = device.device_kind.lower()
  return next((tflops for key, tflops in table if key in kind), None)


def matmul_format(config: MaxTextConfig) -> str:
  """The number format the run's quantized products use: 'int8', 'fp8' or 'bf16'."""
  return {"int8": "int8", "fp8": "fp8", "fp8_full": "fp8"}.get(config.quantization, "bf16")


def measure_matmul_tflops(n: int = 0, fmt: str = "bf16") -> float:
  """[n, n] @ [n, n] throughput of one device in TFLOP/s (TOP/s for int8), measured once per process, size and format:
  bf16 with float32 accumulation, or int8 with int32 accumulation.

  n = 0 picks 1024 on CPU and 8192 on accelerators.
  """
  return _measure(n or (1024 if platform.local_platform() == "cpu" else 8192), fmt)


@functools.cache
def _measure(n: int, fmt: str = "bf16", min_repeats: int = 30, min_seconds: float = 1.5) -> float:
  """Best of at least min_repeats timed matmuls spanning at least min_seconds (the most favourable figure)."""
  device = jax.local_devices()[0]
  dt, acc = (jnp.int8, jnp.int32) if fmt == "int8" else (jnp.bfloat16, jnp.float32)
  a = jax.device_put(jnp.ones((n, n), dt), device)
  b = jax.device_put(jnp.full((n, n), 3 if fmt == "int8" else 0.5, dt), device)
  # float32 accumulation, as the model's matmuls (maxtext.layers.matmul); on XLA:CPU a bf16-output matmul
  # takes a float32 upcast path several times slower than the machine's bf16 units.
  matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=acc))
  matmul(a, b).block_until_ready()
  best, spent, repeats = float("inf"), 0.0, 0
  while repeats < min_repeats or spent < min_seconds:
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    elapsed = time.perf_counter() - start
    best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
  return 2 * n**3 / best / 1e12


def peak_tflops(config: MaxTextConfig) -> tuple[float, str]:
  """(peak TFLOP/s per device in the run's matmul format, where the figure comes from)."""
  if config.device_peak_tflops > 0:
    return config.device_peak_tflops, "config"
  device, fmt = jax.devices()[0], matmul_format(config)
  bf16 = table_peak_tflops(device)
  if bf16 is None:  # CPUs: measured
    if fmt == "int8":
      int8, bf16_rate = measure_matmul_tflops(fmt="int8"), measure_matmul_tflops()
      return (int8, MEASURED_INT8) if int8 >= bf16_rate else (bf16_rate, f"{MEASURED}: faster than this CPU's int8 matmul ({int8:.3f} TOP/s)")
    return measure_matmul_tflops(), MEASURED if fmt == "bf16" else f"{MEASURED}; fp8 products run as float on this CPU"
  if fmt == "int8":
    int8 = table_peak_tflops(device, PEAK_INT8_TOPS)
    return (int8, "chip table, int8") if int8 else (bf16, f"chip table, bf16: no int8 peak is known for {device.device_kind}")
  if fmt == "fp8":
    fp8 = table_peak_tflops(device, PEAK_FP8_TFLOPS)
    return (fp8, "chip table, fp8") if fp8 else (bf16, f"chip table, bf16: {device.device_kind} has no fp8 units, XLA runs fp8 products in bf16")
  return bf16, "chip table"


@dataclasses.dataclass
class Yardstick:
  """The peak TFLOP/s per device that MFU divides by, and where it comes from."""

  tflops: float
  source: str
  measured: bool = False  # a measured figure is a lower bound on the peak, raised by any faster step

  @classmethod
  def of(cls, config: MaxTextConfig) -> Yardstick:
    tflops, source = peak_tflops(config)
    return cls(tflops, source, measured=source.startswith("measured"))

  def mfu(self, achieved_tflops: float) -> float:
    """achieved / peak; a step faster than a measured peak becomes the peak (the device just showed it can)."""
    if self.measured and achieved_tflops > self.tflops:
      self.tflops, self.source = achieved_tflops, "fastest train step so far"
    return achieved_tflops / self.tflops if self.tflops > 0 else 0.0
