"""CPU runs keep large host buffers mapped between executions; accelerator runs keep glibc's defaults."""

import os
import subprocess
import sys

import pytest

from maxtext import host_allocator
from tests.test_train_helpers import tiny_config

# Page faults per execution of a jitted op with a fresh 64 MB output, after warm-up.
_FAULTS = """
import resource, sys
from maxtext import host_allocator
if sys.argv[1] == "tuned":
  assert host_allocator.keep_buffers_mapped()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.tanh(x) * 2 + 1)
x = jnp.ones((4096, 4096), jnp.float32)
for _ in range(30):
  f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  f(x).block_until_ready()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


def _faults_per_call(mode: str) -> int:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=env, capture_output=True, text=True, check=True, timeout=300)
  return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_tuned_allocator_stops_page_faults_per_execution():
  assert _faults_per_call("plain") > 10_000  # 64 MB of fresh 4 KiB pages every call
  assert _faults_per_call("tuned") < 100


def test_only_cpu_runs_are_tuned():
  assert host_allocator.runs_on_cpu(tiny_config(num_devices=1, hardware="cpu"), platforms="cuda")
  assert not host_allocator.runs_on_cpu(tiny_config(num_devices=1, hardware="gpu"), platforms="cpu")
  assert not host_allocator.tune(tiny_config(num_devices=1, hardware="tpu"))
  auto = tiny_config(num_devices=1)
  assert host_allocator.runs_on_cpu(auto)  # the tests run with JAX_PLATFORMS=cpu
  assert not host_allocator.runs_on_cpu(auto, platforms="cuda,cpu")
  assert not host_allocator.runs_on_cpu(auto, platforms="", accelerator_nodes=True)
  assert host_allocator.runs_on_cpu(auto, platforms="", accelerator_nodes=False)
