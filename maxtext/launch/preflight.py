"""The AOT compile check of a launch, run as `python -m maxtext.train_compile` in a CPU-only subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from maxtext.aot.memory import EXIT_DOES_NOT_FIT, DoesNotFit
from maxtext.errors import ConfigError
from maxtext.launch.target import Target


def compile_check(config_argv: Sequence[str], target: Target, timeout_s: float | None = None) -> dict[str, Any]:
  """The JSON report of train_compile for the target; DoesNotFit or ConfigError with its one-line message otherwise."""
  cmd = [sys.executable, "-m", "maxtext.train_compile", *config_argv]
  cmd += [f"compile_topology={target.topo.name}", f"compile_topology_num_slices={target.num_slices}"]
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")} | {"JAX_PLATFORMS": "cpu"}
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    raise ConfigError(f"the AOT compile check did not finish in {timeout_s:.0f}s; run train_compile yourself or pass --skip-compile-check") from None
  lines = done.stdout.strip().splitlines()
  message = next((line.removeprefix("error: ") for line in reversed(done.stderr.strip().splitlines()) if line.startswith("error: ")), "")
  if done.returncode == EXIT_DOES_NOT_FIT:
    raise DoesNotFit(message or "does not fit (see python -m maxtext.train_compile)")
  if done.returncode != 0 or not lines:
    why = message or (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise ConfigError(f"the AOT compile check for {target.topo.name} x {target.num_slices} failed: {why}; fix it or pass --skip-compile-check")
  return json.loads(lines[-1])
