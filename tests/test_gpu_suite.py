"""benchmarks/gpu_suite.py: the smoke run on CPU reports every section and passes; the checks fail where they must.

The smoke run is one subprocess (the exit code is what a GPU session reads) with XLA's backend optimisations off
(the same programs, compiled faster: the figures of a smoke run mean nothing anyway) and one throughput row.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402


def test_smoke_run_reports_every_section(tmp_path):
  out = tmp_path / "report.md"
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(None, "--xla_cpu_enable_xprof_traceme=true")}
  suite = [str(ROOT / "benchmarks/gpu_suite.py"), "--smoke", "--out", str(out), "--workdir", str(tmp_path / "work")]
  argv = [sys.executable, *suite, "--rows", "1B-class, default", "--profile", "1B-class", "--profile_decode", "1", "--profile_steps", "1"]
  proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = out.read_text()
  assert report in proc.stdout
  assert "(smoke: tiny shapes, not GPU figures)" in report
  for title in gpu_suite.TITLES.values():
    assert f"| {title} | pass |" in report and f"## {title}" in report
  assert "**FAIL**" not in report
  assert "| 1B-class, default | (model keys only) | full |" in report
  assert "On CPU there is no cuDNN" in report  # the CPU's fused kernel is named as such, never as cuDNN
  assert "| greedy tokens equal the CPU's | pass |" in report
  assert "| scanned, batch 2: one decode step compile | pass |" in report and "| unstacked, batch 1: one decode step compile | pass |" in report
  for profiled in ("Profile: 1B-class, default", "Profile: decode step, scanned layers, batch 1"):  # top ops by time: a table with rows
    assert f"**{profiled}**" in report and report.split(f"**{profiled}**")[1].split("\n\n")[1].startswith("| op | ms / step |"), profiled


def test_tolerance_checks():
  a = {"w": np.ones((3, 4)), "b": np.full((2,), 2.0)}
  assert gpu_suite.relative_error(a, a) == 0.0
  b = {"w": a["w"] * 1.01, "b": a["b"] * 1.01}
  assert gpu_suite.relative_error(b, a) == pytest.approx(0.01)
  assert gpu_suite.relative_error(np.zeros(3), np.zeros(3)) == 0.0
  assert gpu_suite.relative_error(np.ones(3), np.zeros(3)) == math.inf
  assert gpu_suite.within(0.01, gpu_suite.LOSS_RTOL) and not gpu_suite.within(0.02, gpu_suite.LOSS_RTOL)
  assert not gpu_suite.within(float("nan"), 1.0) and not gpu_suite.within(math.inf, 1.0)


def test_probe_inputs_and_exit_code(tmp_path):
  seg = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
  batch = {"inputs": np.arange(12).reshape(2, 6), "inputs_segmentation": seg, "targets_segmentation": seg}
  perturbed, in_a, in_b = gpu_suite.perturb_first_document(batch, vocab=1000)
  assert in_a.tolist() == [[True, True, False, False, False, False], [False] * 6]  # only rows with several documents
  assert in_b.tolist() == [[False, False, True, True, True, False], [False] * 6]
  assert (perturbed["inputs"][~in_a] == batch["inputs"][~in_a]).all()
  assert gpu_suite.merged(batch)["inputs_segmentation"].tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6]

  report = gpu_suite.Report(["# test"], str(tmp_path / "r.md"))
  ok = gpu_suite.Section("a", "A")
  ok.check("fine", True, "")
  report.add(ok)
  assert report.exit_code() == 0
  bad = gpu_suite.Section("b", "B")
  bad.check("loss", gpu_suite.within(0.5, gpu_suite.LOSS_RTOL), "too far")
  report.add(bad)
  assert report.exit_code() == 1 and "| loss | **FAIL** | too far |" in (tmp_path / "r.md").read_text()
  raised = gpu_suite.Report([], None)
  raised.add(gpu_suite.Section("c", "C", error="RuntimeError: boom"))
  assert raised.exit_code() == 1
