"""Pipeline parallelism on simulated CPU devices: the measured bubble against the formula, and the collective bytes of a
pipelined train step against the unpipelined one, read from the compiled modules.

    python benchmarks/pipeline_bubble.py [--stages 4] [--layers_per_stage 1] [--microbatches 4,8,16] [key=value ...]

Bubble. The pipelined layer stack (the `pipeline.Schedule` wrapped around the main layer stack, forward and backward) is compiled and timed for each
microbatch count m, with the microbatch size held fixed. Every iteration runs every stage (bubble iterations compute on
zeros), so the time is T(m) = t_iter x (m v + d (p - 1)) + c. A least-squares line through T against the useful
iterations m v gives t_iter (the slope); the measured bubble at m is the share of T(m) that is not useful work,
1 - m v t_iter / T(m), printed beside the formula d (p - 1) / (m v + d (p - 1)).

Collectives. The train step `python -m maxtext.train` compiles, pipelined (stage axis x fsdp), with
pipeline_fsdp_ag_once, and unpipelined (the stage axis turned into data parallelism, same global batch): bytes per device
per step of every collective kind (benchmarks/hlo_collectives.py).

One JSON line per measurement; XLA_FLAGS gives 8 host devices unless set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

MODEL = dict(
  base_emb_dim=256,
  base_num_query_heads=4,
  base_num_kv_heads=4,
  head_dim=64,
  base_mlp_dim=1024,
  vocab_size=1024,
  max_target_length=256,
  dataset_type="synthetic",
  dtype="float32",
  remat_policy="full",
)


def layer_stack_seconds(config, repeats: int) -> float:
  """Best time of `repeats` runs of the pipelined layer stack, forward and backward, on a random microbatched input."""
  from flax import nnx

  from maxtext import mesh as mesh_lib
  from maxtext import models

  mesh = mesh_lib.create(config)
  with jax.set_mesh(mesh):
    model = models.create_sharded(config, mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    b, s = config.global_batch_size_to_train_on, config.max_target_length
    tokens = jax.random.randint(jax.random.key(0), (b, s), 1, config.vocab_size)
    positions = jax.numpy.broadcast_to(jax.numpy.arange(s), (b, s))
    windows = [kind.window for kind in model.specs.kinds]

    def loss(params):
      m = nnx.merge(graphdef, params, rest)
      y, _ = m.specs.pipeline(m.layers, m.input_stream(tokens), positions, None, None, windows, m.policy)
      return jax.numpy.mean(y**2)

    step = jax.jit(jax.grad(loss))
    jax.block_until_ready(step(params))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(step(params))
      times.append(time.perf_counter() - start)
  return min(times)


def collective_report(config) -> dict:
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from compiled_step import compile_train_step
  from hlo_collectives import collective_bytes

  step = compile_train_step(config)
  return {k: v / 2**20 if k != "unknown_trip_loops" else v for k, v in collective_bytes(step.compiled.as_text()).items()}


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--layers_per_stage", type=int, default=1)
  parser.add_argument("--repeats_per_stage", type=int, default=2, help="num_pipeline_repeats (layers = stages x layers_per_stage x this)")
  parser.add_argument("--microbatches", default="4,8,16")
  parser.add_argument("--microbatch_rows", type=int, default=8, help="sequences per microbatch (fixed while m varies)")
  parser.add_argument("--timing_runs", type=int, default=5)
  parser.add_argument("overrides", nargs="*", help="key=value config overrides")
  args = parser.parse_args(argv)

  from maxtext.config import from_overrides
  from maxtext.models import pipeline_specs

  devices = jax.device_count()
  p, lps, v = args.stages, args.layers_per_stage, args.repeats_per_stage
  extra = dict(o.split("=", 1) for o in args.overrides)
  base = {**MODEL, "base_num_decoder_layers": p * lps * v, "ici_pipeline_parallelism": p, "ici_fsdp_parallelism": devices // p, **extra}
  base["num_layers_per_pipeline_stage"] = lps

  rows = []
  for m in (int(x) for x in args.microbatches.split(",")):
    config = from_overrides(num_devices=devices, **base, num_pipeline_microbatches=m, per_device_batch_size=m * args.microbatch_rows / devices)
    plan = pipeline_specs.pipeline_plan(config)
    rows.append((m, plan, layer_stack_seconds(config, args.timing_runs)))
  useful = np.array([m * plan.repeats for m, plan, _ in rows], float)
  seconds = np.array([t for *_, t in rows])
  slope, intercept = np.polyfit(useful, seconds, 1)
  for (m, plan, t), u in zip(rows, useful, strict=True):
    print(
      json.dumps(
        {
          "measure": "bubble",
          "stages": plan.stages,
          "repeats": plan.repeats,
          "microbatches": m,
          "iterations": plan.iterations,
          "layer_stack_seconds": round(t, 4),
          "seconds_per_iteration_fit": round(slope, 5),
          "intercept_seconds": round(intercept, 4),
          "measured_bubble": round(1 - u * slope / t, 4),
          "formula_bubble": round(plan.bubble, 4),
        }
      ),
      flush=True,
    )

  m = int(args.microbatches.split(",")[0])
  batch = dict(per_device_batch_size=m * args.microbatch_rows / devices)
  pipelined = from_overrides(num_devices=devices, **base, num_pipeline_microbatches=m, **batch)
  gathered_once = from_overrides(num_devices=devices, **base, num_pipeline_microbatches=m, pipeline_fsdp_ag_once=True, **batch)
  flat = {k: v for k, v in base.items() if k not in ("ici_pipeline_parallelism", "num_layers_per_pipeline_stage")}
  unpipelined = from_overrides(num_devices=devices, **flat, ici_data_parallelism=p, **batch)
  for name, config in (("unpipelined", unpipelined), ("pipelined", pipelined), ("pipelined_fsdp_ag_once", gathered_once)):
    report = collective_report(config)
    total = sum(v for k, v in report.items() if k != "unknown_trip_loops")
    print(
      json.dumps({"measure": "collectives_MiB_per_device_per_step", "step": name, "total": round(total, 2), **{k: round(v, 2) for k, v in report.items()}}),
      flush=True,
    )


if __name__ == "__main__":
  main(sys.argv[1:])
