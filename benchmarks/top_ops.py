"""Where a jitted step's device time goes: trace N calls with jax.profiler and rank the XLA ops by total time.

`profile(run, steps)` traces `steps` calls of `run` (each synchronised by the caller's function) and reads the XSpace
jax.profiler wrote (jax.profiler.ProfileData). The ops are the device planes' events (GPU kernels and copies, TPU ops),
named by their HLO op (the `hlo_op` stat, or `hlo_op=` in the kernel's annotation; else the kernel's own name); on
hosts without a device plane (CPU) the host threads' events that carry an `hlo_op` stat, which XLA:CPU records only with
XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true. `markdown(result)` renders the top ops as a table.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

# Lines of a device plane that repeat the ops of other lines (derived timelines), not ops of their own.
DERIVED_LINES = ("XLA Modules", "Steps", "Framework Name Scope", "Framework Ops", "Source code", "XLA TraceMe", "Async XLA Ops", "SparseCore")
CPU_FLAG = "--xla_cpu_enable_xprof_traceme=true"
CONTAINERS = re.compile(r"(while|conditional|call)(\.\d+)?$")  # XLA:CPU's control-flow thunks: their time is their body ops' time


def _op_name(event: Any) -> str | None:
  """The HLO op an event ran (None: not an op)."""
  stats = dict(event.stats)
  if "hlo_op" in stats:
    return str(stats["hlo_op"])
  for value in stats.values():
    found = re.search(r"hlo_op=([^,#\s]+)", str(value))
    if found:
      return found.group(1)
  return None


def _device_lines(plane: Any) -> list[Any]:
  lines = list(plane.lines)
  ops = [line for line in lines if line.name == "XLA Ops"]
  if ops:
    return ops
  streams = [line for line in lines if line.name.startswith("Stream")]
  return streams or [line for line in lines if not line.name.startswith(DERIVED_LINES)]


def op_times(xspace_path: str) -> tuple[str, dict[str, list[float]], list[str]]:
  """(where the ops came from, op -> durations in ms, the planes and lines seen) from one .xplane.pb."""
  from jax.profiler import ProfileData

  data = ProfileData.from_file(xspace_path)
  planes = list(data.planes)
  seen = [f"{p.name}: " + ", ".join(f"{line.name} ({sum(1 for _ in line.events)})" for line in p.lines) for p in planes if list(p.lines)]
  times: dict[str, list[float]] = collections.defaultdict(list)
  devices = [p for p in planes if p.name.startswith("/device:") and list(p.lines)]
  if devices:
    for plane in devices:
      for line in _device_lines(plane):
        for e in line.events:
          times[_op_name(e) or e.name].append(e.duration_ns / 1e6)
    return "device planes " + ", ".join(p.name for p in devices), times, seen
  for plane in planes:
    if plane.name.startswith("/host:"):
      for line in plane.lines:
        for e in line.events:
          op = _op_name(e)
          if op and not e.name.startswith("end:") and not CONTAINERS.match(op):
            times[op].append(e.duration_ns / 1e6)
  return "host threads (XLA:CPU op events)", times, seen


def describe(op: str, hlo: str) -> str:
  """The op's result shape and the JAX op it came from, from the compiled HLO text ('' when not found)."""
  line = re.search(rf"%{re.escape(op)} = ([^\n]*)", hlo)
  if not line:
    return ""
  source = re.search(r'op_name="([^"]*)"', line.group(1))
  return line.group(1).split(" ")[0][:60] + (f" from {source.group(1)[-70:]}" if source else "")


def profile(run: Callable[[], Any], steps: int, top: int = 15, hlo: str = "") -> dict:
  """Trace `steps` calls of run (which must block until its step is done) and return {"steps", "wall_ms_per_step",
  "op_ms_per_step" (all ops' time summed over streams and threads), "source", "ops": the `top` ops by total time
  ({"op", "ms_per_step", "share", "calls_per_step", "what"}), "planes"}."""
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      start = time.perf_counter()
      for _ in range(steps):
        run()
      wall = time.perf_counter() - start
    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not paths:
      raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {trace_dir}")
    source, times, seen = op_times(paths[0])
  total = sum(sum(v) for v in times.values())
  ranked = sorted(times.items(), key=lambda kv: -sum(kv[1]))[:top]
  ops = [
    {
      "op": op,
      "ms_per_step": round(sum(d) / steps, 4),
      "share": round(sum(d) / total, 4) if total else 0.0,
      "calls_per_step": round(len(d) / steps, 2),
      "what": describe(op, hlo),
    }
    for op, d in ranked
  ]
  return {
    "steps": steps,
    "wall_ms_per_step": round(wall * 1e3 / steps, 3),
    "op_ms_per_step": round(total / steps, 3),
    "source": source,
    "ops": ops,
    "planes": seen,
  }


def safe_profile(run: Callable[[], Any], steps: int, top: int = 15, hlo: str = "") -> dict:
  """profile(), or {"error": the first line of why tracing failed} (e.g. no CUPTI on a GPU host): a failed trace must
  not cost the measurement it was added to."""
  try:
    return profile(run, steps, top, hlo)
  except Exception as e:  # noqa: BLE001 - reported in the table's place
    return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}


def markdown(result: dict, title: str) -> list[str]:
  """The profile as Markdown lines: a summary line and the top-ops table (or why there is none)."""
  if "error" in result:
    return [f"**{title}**: no profile ({result['error']}).", ""]
  lines = [
    f"**{title}**: {result['steps']} traced steps, {result['wall_ms_per_step']:.3f} ms wall per step, ops {result['op_ms_per_step']:.3f} ms "
    f"per step summed ({result['source']}).",
    "",
  ]
  if not result["ops"]:
    hint = f" (on CPU set XLA_FLAGS={CPU_FLAG})" if jax.default_backend() == "cpu" else ""
    return lines + [f"No XLA op events in the trace{hint}; planes: {'; '.join(result['planes'])[:600]}", ""]
  lines += ["| op | ms / step | share | calls / step | shape, from |", "|---|---|---|---|---|"]
  lines += [
    f"| `{o['op'][:80]}` | {o['ms_per_step']:.4f} | {o['share']:.1%} | {o['calls_per_step']:g} | {o['what'].replace('|', '/')} |" for o in result["ops"]
  ]
  return lines + [""]
