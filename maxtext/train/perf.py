"""Device peak throughput (for MFU): config value, else the chip table, else measured once."""

from __future__ import annotations

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
def _measure(n: int, min_repeats: int = 10, min_seconds: float = 0.5) -> float:
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
  return measure_matmul_tflops(), "measured bf16 matmul"
