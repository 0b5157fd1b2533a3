"""Where one train step's time goes: `python benchmarks/step_profile.py <config.yml> key=value ... [--top N]`.

Compiles the step `python -m maxtext.train` runs, traces `--steps` steps with `jax.profiler`, and
prints one JSON line per op of the last traced step (start and duration in ms, HLO shape, the JAX
op it came from), largest first, then the host's streaming bandwidth (a jitted `x * 1.5 + 1` over
256 MB). On CPU set `XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true` so XLA records each op.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp


def _ops_of_last_step(trace_dir: str) -> tuple[float, list[dict]]:
  """(step ms, the ops that started inside the last traced execution) from the Perfetto trace."""
  (path,) = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)
  events = json.load(gzip.open(path))
  events = [e for e in (events["traceEvents"] if isinstance(events, dict) else events) if e.get("ph") == "X"]
  step = [e for e in events if e["name"] == "ThunkExecutor::Execute (wait for completion)"][-1]
  ops = [e for e in events if step["ts"] <= e["ts"] <= step["ts"] + step["dur"] and not e["name"].startswith(("Thunk", "Slinky", "Threadpool", "end:", "$"))]
  return step["dur"] / 1e3, [{"op": e["name"], "start_ms": round((e["ts"] - step["ts"]) / 1e3, 2), "ms": round(e["dur"] / 1e3, 2)} for e in ops]


def _describe(op: str, hlo: str) -> dict:
  line = re.search(rf"%{re.escape(op)} = ([^\n]*)", hlo)
  if not line:
    return {}
  source = re.search(r'op_name="([^"]*)"', line.group(1))
  return {"shape": line.group(1).split(" ")[0], "from": source.group(1)[-80:] if source else ""}


def stream_gb_per_s(megabytes: int = 256) -> float:
  """Read + write bandwidth of a jitted elementwise op over `megabytes` of float32, best of 10."""
  x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
  op = jax.jit(lambda x: x * 1.5 + 1.0)
  op(x).block_until_ready()
  best = float("inf")
  for _ in range(10):
    start = time.perf_counter()
    op(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * x.nbytes / best / 1e9


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=3, help="traced steps (after 3 untraced ones)")
  parser.add_argument("--top", type=int, default=30)
  parser.add_argument("config", nargs="+", help="<config.yml> key=value ...")
  args = parser.parse_args(argv)

  from compiled_step import compile_train_step

  from maxtext.config import load
  from maxtext.process import prepare
  from maxtext.train.loop import create_data_iterator

  config = load(args.config, devices=prepare)
  step = compile_train_step(config)
  with jax.set_mesh(step.mesh), tempfile.TemporaryDirectory() as trace_dir:
    state = step.init_state()
    batch = next(create_data_iterator(config, step.mesh, "train"))
    for _ in range(3):
      state, metrics = step.compiled(state, batch)
    jax.block_until_ready(metrics)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(args.steps):
        state, metrics = step.compiled(state, batch)
        jax.block_until_ready(metrics)
    step_ms, ops = _ops_of_last_step(trace_dir)
  hlo = step.compiled.as_text()
  print(json.dumps({"traced_step_ms": round(step_ms, 1), "ops": len(ops)}))
  for op in sorted(ops, key=lambda o: -o["ms"])[: args.top]:
    print(json.dumps({**op, **_describe(op["op"], hlo)}))
  print(json.dumps({"stream_gb_per_s": round(stream_gb_per_s(), 1)}))


if __name__ == "__main__":
  main(sys.argv[1:])
