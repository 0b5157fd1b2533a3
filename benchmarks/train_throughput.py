"""Train-step throughput: `python benchmarks/train_throughput.py <config.yml> key=value ...` prints one JSON line.

Compiles exactly the step `python -m maxtext.train` runs, times `bench_steps` steps after
`warmup_steps` (each step synchronised, so the figures are per-step device time), and measures
this machine's bf16 matmul throughput in the same process as the yardstick. For MoE configs it also
reports the time and share of the step spent in routing, dispatch and combine (benchmarks/moe_share.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax


def main(argv: list[str]) -> dict:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--warmup_steps", type=int, default=2)
  parser.add_argument("--bench_steps", type=int, default=10)
  parser.add_argument("--matmul_size", type=int, default=0, help="side of the square bf16 matmul yardstick; 0 -> 1024 on CPU, 8192 elsewhere")
  parser.add_argument("--profile_steps", type=int, default=0, help="then trace this many steps and add the top ops by device time (benchmarks/top_ops.py)")
  parser.add_argument("config", nargs="+", help="<config.yml> key=value ...")
  args = parser.parse_args(argv)

  from maxtext.config import load
  from maxtext.process import prepare
  from maxtext.train import perf

  config = load(args.config, devices=prepare)
  result = measure(config, args.warmup_steps, args.bench_steps, perf.measure_matmul_tflops(args.matmul_size), profile_steps=args.profile_steps)
  print(json.dumps(result), flush=True)
  return result


def measure(
  config, warmup_steps: int, bench_steps: int, matmul_tflops: float, log=None, moe_share: bool = True, profile_steps: int = 0, profile_top: int = 15
) -> dict:
  """Compile config's train step (remat_policy=auto resolved as train does; log gets its choice), run warmup_steps
  then bench_steps synchronised steps on the config's data, and return the figures of the module docstring (the
  routing share of MoE configs unless moe_share is False). profile_steps > 0: then traces that many more steps and
  adds "top_ops" (benchmarks/top_ops.py: the profile_top ops by device time). The train state lives only inside this
  call, so callers can measure one large model after another."""
  from compiled_step import compile_train_step

  from maxtext import counting
  from maxtext.train import perf
  from maxtext.train.loop import create_data_iterator

  step = compile_train_step(config, log)
  config, mesh, compiled = step.config, step.mesh, step.compiled
  with jax.set_mesh(mesh):
    state = step.init_state()
    data = create_data_iterator(config, mesh, "train")
    step_s, data_s = [], []
    for i in range(warmup_steps + bench_steps):
      start = time.perf_counter()
      batch = jax.block_until_ready(next(data))
      waited = time.perf_counter() - start
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      if i >= warmup_steps:
        step_s.append(time.perf_counter() - start)
        data_s.append(waited)
    final_loss = float(metrics["loss"])
    top = None
    if profile_steps:
      import top_ops

      def one_step(batch=batch):
        nonlocal state, metrics
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)

      top = top_ops.safe_profile(one_step, profile_steps, profile_top, compiled.as_text())
    del state, batch, metrics
    if hasattr(data, "close"):
      data.close()

  seconds = statistics.median(step_s)
  tflops = counting.flops_per_device_per_step(config) / seconds / 1e12
  peak, peak_source = perf.peak_tflops(config)
  memory = compiled.memory_analysis()
  stats = jax.local_devices()[0].memory_stats() or {}
  result = {
    "backend": jax.default_backend(),
    "device_kind": jax.devices()[0].device_kind,
    "num_devices": config.num_devices,
    "remat_policy": config.remat_policy,
    "compile_seconds": round(step.compile_seconds, 3),
    "median_step_seconds": round(seconds, 5),
    "tokens_per_second_per_device": round(config.global_batch_size_to_train_on * config.max_target_length / config.num_devices / seconds, 1),
    "tflops_per_second_per_device": round(tflops, 4),
    "mfu": round(tflops / peak, 4),
    "mfu_peak_tflops": peak,
    "mfu_peak_source": peak_source,
    "measured_bf16_matmul_tflops": round(matmul_tflops, 4),
    "fraction_of_measured_matmul": round(tflops / matmul_tflops, 4),
    "compiled_temp_bytes": memory.temp_size_in_bytes if memory else None,
    "compiled_argument_bytes": memory.argument_size_in_bytes if memory else None,
    "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
    "median_data_wait_seconds": round(statistics.median(data_s), 5),
    "final_loss": final_loss,
  }
  if top is not None:
    result["top_ops"] = top
  if config.num_experts > 1 and moe_share:
    from moe_share import routing_dispatch_seconds

    routing = routing_dispatch_seconds(config)
    result.update(routing_dispatch_seconds=round(routing, 5), routing_dispatch_share=round(routing / seconds, 4))
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
