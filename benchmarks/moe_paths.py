"""MoE dispatch paths compared in one process: `python benchmarks/moe_paths.py <config.yml> key=value ... [--rounds R] [--steps N]`.

Compiles the train step `python -m maxtext.train` runs once per dispatch path (MaxText's keys: `sparse_matmul=false`
-> dense, `megablox=false` -> ragged_dot, `use_tokamax_gmm=true` -> tokamax; megablox itself needs a TPU), then
runs the paths in turn, `--steps` synchronised steps each, for `--rounds` rounds, and keeps each path's best
median step (interleaving makes the ratios fair on a shared machine). Prints one JSON line per path, then one
with the path the platform policy picks under MaxText's defaults (`sparse_matmul=true megablox=true`) and its time
relative to the fastest path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax

PATHS = {"dense": ["sparse_matmul=false"], "ragged_dot": ["megablox=false"], "tokamax": ["use_tokamax_gmm=true"]}


def main(argv: list[str]) -> dict:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("config", nargs="+", help="<config.yml> key=value ...")
  args = parser.parse_args(argv)

  from compiled_step import compile_train_step

  from maxtext import platform
  from maxtext.config import load
  from maxtext.process import prepare
  from maxtext.train.loop import create_data_iterator

  steps, states, data = {}, {}, {}
  for name, keys in PATHS.items():
    config = load([*args.config, *keys], devices=prepare)
    steps[name] = compile_train_step(config)
    with jax.set_mesh(steps[name].mesh):
      states[name] = steps[name].init_state()
      data[name] = create_data_iterator(config, steps[name].mesh, "train")
  default = platform.moe_dispatch(load(args.config), platform.local_platform())
  best: dict[str, float] = {}
  for _ in range(args.rounds):
    for name, step in steps.items():
      with jax.set_mesh(step.mesh):
        state, seconds = states[name], []
        for _ in range(args.steps + 1):  # the first step of a round warms the caches
          batch = jax.block_until_ready(next(data[name]))
          start = time.perf_counter()
          state, metrics = step.compiled(state, batch)
          jax.block_until_ready(metrics)
          seconds.append(time.perf_counter() - start)
        states[name] = state
        best[name] = min(best.get(name, float("inf")), statistics.median(seconds[1:]))
  fastest = min(best.values())
  for name, step in steps.items():
    memory = step.compiled.memory_analysis()
    line = {"path": name, "best_median_step_seconds": round(best[name], 5), "vs_fastest": round(best[name] / fastest, 3)}
    line.update(compile_seconds=round(step.compile_seconds, 2), compiled_temp_bytes=memory.temp_size_in_bytes if memory else None)
    print(json.dumps(line), flush=True)
  summary = {"default_path": default, "default_vs_fastest": round(best[default] / fastest, 3) if default in best else None}
  summary.update(backend=jax.default_backend(), rounds=args.rounds, steps=args.steps)
  print(json.dumps(summary), flush=True)
  return summary


if __name__ == "__main__":
  main(sys.argv[1:])
