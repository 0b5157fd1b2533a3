"""The platform seam: loading a config starts no JAX backend and pulls in no layers, device questions are answered
by maxtext.platform (device counts without starting JAX, the fused attention kernel in the policy), `import maxtext`
keeps JAX off a TPU backend the host does not have, and the CPU MFU yardstick is measured once per host."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest

from maxtext import platform
from maxtext.config import from_overrides, load
from maxtext.layers import attention_ops
from maxtext.train import perf
from tests.xla_env import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FRESH = """
import contextlib, io, json, os, sys
import maxtext.config
layers_on_import = "maxtext.layers" in sys.modules
config = maxtext.config.load(["configs/base.yml"], env={})
from maxtext.config.__main__ import main as explain
from maxtext.train.__main__ import main as train
with contextlib.redirect_stdout(io.StringIO()) as out:
  explain(["configs/base.yml", "--json"])
  train(["--help"])
from jax._src import xla_bridge
started = xla_bridge.backends_are_initialized()
import jax
print(json.dumps({"layers": layers_on_import, "started": started, "devices": config.num_devices,
                  "explained": json.loads(out.getvalue().split("\\nusage:")[0])["num_devices"]["value"],
                  "jax_platforms": os.environ.get("JAX_PLATFORMS"), "platform": jax.devices()[0].platform}))
"""


def test_loading_a_config_starts_no_backend_and_imports_no_layers():
  """A fresh interpreter without JAX_PLATFORMS: import maxtext.config, load a config, explain it, print --help;
  no backend has started and maxtext.layers was not imported. Then JAX starts on the platform `import maxtext`
  chose, and an installed libtpu prints nothing."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_STDERR_LOG_LEVEL", "TPU_MIN_LOG_LEVEL")}
  env.update(PYTHONPATH=REPO, XLA_FLAGS=xla_flags(3))
  proc = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
  assert proc.returncode == 0, proc.stderr
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["layers"] is False and got["started"] is False
  assert got["devices"] == got["explained"] == 3  # counted without starting JAX
  if not platform.has_tpu_chips():
    assert got["jax_platforms"] == "cpu" and got["platform"] == "cpu"
    assert proc.stderr.strip() == "", proc.stderr  # no libtpu initialisation messages


def test_device_counts_predicted_without_jax():
  assert platform.predicted_device_counts("cpu", {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}) == (8, 1)
  assert platform.predicted_device_counts("cpu", {}) == (1, 1)
  assert platform.predicted_device_counts("gpu", {"CUDA_VISIBLE_DEVICES": "0,3"}) == (2, 1)
  local = max(len(platform._nodes(platform._TPU_NODES)), 1)
  assert platform.predicted_device_counts("tpu", {"TPU_WORKER_HOSTNAMES": "h0,h1", "MEGASCALE_NUM_SLICES": "2"}) == (4 * local, 2)
  assert platform.device_counts(from_overrides(num_devices=1)) == (8, 1)  # conftest: 8 CPU devices (JAX's own once it has started)


def test_load_takes_device_counts_from_the_entry_points_function():
  seen = []
  config = load([f"{REPO}/configs/base.yml"], env={}, devices=lambda user: seen.append(user.steps) or (4, 2))
  assert seen == [config.steps] and (config.num_devices, config.num_slices, config.dcn_parallelism[0]) == (4, 2, 2)


def test_policy_names_the_fused_attention_kernel_and_every_field_says_why():
  config = from_overrides(num_devices=1, attention="flash")
  facts = dict(dtype="bfloat16", head_dim=64, q_len=1024, kv_len=1024, soft_cap=None)
  for name, kernel in (("tpu", "splash"), ("gpu", "cudnn"), ("cpu", "chunked")):
    policy = platform.for_platform(config, name)
    assert policy.fused_attention == kernel and attention_ops.select(policy, **facts) == kernel
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.fused_attention = "splash"
  source = inspect.getsource(platform.Policy).splitlines()
  fields = [line for line in source if line.startswith("  ") and ":" in line and not line.lstrip().startswith(('"', "#"))]
  assert len(fields) == len(dataclasses.fields(platform.Policy)) and all("  # " in line for line in fields)


def test_measured_yardstick_is_cached_per_host(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  measured = []
  monkeypatch.setattr(perf, "measure_matmul_tflops", lambda n=0, fmt="bf16": measured.append(n) or 0.25)
  monkeypatch.setattr(perf, "fresh_matmul_tflops", lambda fmt="bf16": 0.25)  # a step near the yardstick re-measures it
  config = from_overrides(num_devices=1)
  first, second = perf.Yardstick.of(config), perf.Yardstick.of(config)
  assert measured == [0] and first.tflops == second.tflops == 0.25  # measured once, then read back
  assert first.source.endswith("now") and second.source.endswith("from this host")
  assert f"cached in {tmp_path / 'maxtext' / 'peak_tflops.json'}" in first.described()
  assert second.mfu(0.5) == 1.0 and perf.Yardstick.of(config).tflops == 0.5  # a faster step raises the cached figure
  assert perf.Yardstick.of(config.model_copy(update={"device_peak_tflops": 2.0})).source == "config"
