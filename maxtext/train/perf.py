"""Device peak throughput (for MFU): config value, else the chip table, else measured once.

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

MEASURED = "measured bf16 matmul, best of 1.5 s"

BACKEND_OF_HARDWARE = {"cpu": "cpu", "gpu": "gpu", "gpu_multiprocess": "gpu", "tpu": "tpu"}


def check_hardware(config: MaxTextConfig) -> None:
  """config.hardware (unless 'auto') must name the backend JAX uses."""
  if config.hardware == "auto":
    return
  want, have = BACKEND_OF_HARDWARE[config.hardware], platform.local_platform()
  if want != have:
    raise ConfigError(f"hardware={config.hardware} but JAX runs on '{have}'; set hardware=auto or hardware={have}, or fix the JAX install")


def table_peak_tflops(device: jax.Device) -> float | None:
  kind = device.device_kind.lower()
  return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in kind), None)


def measure_matmul_tflops(n: int = 0) -> float:
  """bf16 [n, n] @ [n, n] throughput (float32 accumulation) of one device in TFLOP/s, measured once per process and size.

  n = 0 picks 1024 on CPU and 8192 on accelerators.
  """
  return _measure(n or (1024 if platform.local_platform() == "cpu" else 8192))


@functools.cache
def _measure(n: int, min_repeats: int = 30, min_seconds: float = 1.5) -> float:
  """Best of at least min_repeats timed matmuls spanning at least min_seconds (the most favourable figure)."""
  device = jax.local_devices()[0]
  a = jax.device_put(jnp.ones((n, n), jnp.bfloat16), device)
  b = jax.device_put(jnp.full((n, n), 0.5, jnp.bfloat16), device)
  # float32 accumulation, as the model's matmuls (maxtext.layers.matmul); on XLA:CPU a bf16-output matmul
  # takes a float32 upcast path several times slower than the machine's bf16 units.
  matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  matmul(a, b).block_until_ready()
  best, spent, repeats = float("inf"), 0.0, 0
  while repeats < min_repeats or spent < min_seconds:
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    elapsed = time.perf_counter() - start
    best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
  return 2 * n**3 / best / 1e12


def peak_tflops(config: MaxTextConfig) -> tuple[float, str]:
  """(peak bf16 TFLOP/s per device, where the figure comes from)."""
  if config.device_peak_tflops > 0:
    return config.device_peak_tflops, "config"
  table = table_peak_tflops(jax.devices()[0])
  if table is not None:
    return table, "chip table"
  return measure_matmul_tflops(), MEASURED


@dataclasses.dataclass
class Yardstick:
  """The peak TFLOP/s per device that MFU divides by, and where it comes from."""

  tflops: float
  source: str
  measured: bool = False  # a measured figure is a lower bound on the peak, raised by any faster step

  @classmethod
  def of(cls, config: MaxTextConfig) -> Yardstick:
    tflops, source = peak_tflops(config)
    return cls(tflops, source, measured=source == MEASURED)

  def mfu(self, achieved_tflops: float) -> float:
    """achieved / peak; a step faster than a measured peak becomes the peak (the device just showed it can)."""
    if self.measured and achieved_tflops > self.tflops:
      self.tflops, self.source = achieved_tflops, "fastest train step so far"
    return achieved_tflops / self.tflops if self.tflops > 0 else 0.0
