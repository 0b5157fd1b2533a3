"""mHC and LoRA costs: `python benchmarks/mhc_lora.py [--mhc_rate 4] [<config.yml> key=value ...]` prints JSON lines.

For the config (default: configs/quickstart.yml on synthetic data) it compiles and times the train
step of three variants, exactly as `python -m maxtext.train` builds them:
  plain  mHC off, full finetuning (every parameter trains)
  mhc    mhc_expansion_rate = --mhc_rate
  lora   lora.enable_lora = true (base frozen; the optimizer holds state for the adapters only)
and reports compile seconds, XLA's temporary bytes (activations), median step seconds (the variants' steps run round-robin, so a load
change on a shared host hits all of them alike), and the bytes of parameters, trainable parameters
and optimizer state (from the compiled state's shapes, so the numbers do not depend on the device).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import jax

DEFAULT_CONFIG = ["configs/quickstart.yml", "dataset_type=synthetic", "eval_interval=-1"]


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def build(config_args: list[str]) -> dict:
  """Compile one variant's train step and create its state and batch (nothing timed yet but the compile)."""
  from compiled_step import compile_train_step

  from maxtext.config import load
  from maxtext.process import prepare
  from maxtext.train import state as state_lib
  from maxtext.train import trainable as trainable_lib
  from maxtext.train.loop import create_data_iterator

  config = load(config_args, devices=prepare)
  step = compile_train_step(config)
  with jax.set_mesh(step.mesh):
    state = step.init_state()
    batch = jax.block_until_ready(next(create_data_iterator(config, step.mesh, "train")))
  abstract = step.setup.abstract_state
  trainable, _ = trainable_lib.split_params(abstract["params"], config)
  sizes = {
    "compile_seconds": round(step.compile_seconds, 3),
    "param_bytes": _bytes(abstract["params"]),
    "trainable_param_bytes": _bytes(trainable),
    "optimizer_state_bytes": _bytes(abstract["opt_state"]),
    "checkpointed_param_bytes": _bytes(state_lib.checkpointed(abstract, config)["params"]),
    "temp_bytes": step.compiled.memory_analysis().temp_size_in_bytes,  # activations and other temporaries (XLA)
  }
  return {"step": step, "state": state, "batch": batch, "sizes": sizes, "times": [], "losses": []}


def run_one_step(variant: dict, timed: bool) -> None:
  """One step of a variant, timed until its loss is on the host (the step's results are ready)."""
  with jax.set_mesh(variant["step"].mesh):
    start = time.perf_counter()
    variant["state"], metrics = variant["step"].compiled(variant["state"], variant["batch"])
    variant["losses"].append(float(metrics["loss"]))  # synchronises: per-step device time
    if timed:
      variant["times"].append(time.perf_counter() - start)


def main(argv: list[str]) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mhc_rate", type=int, default=4)
  parser.add_argument("--warmup_steps", type=int, default=2)
  parser.add_argument("--bench_steps", type=int, default=5)
  parser.add_argument("config", nargs="*", help="<config.yml> key=value ... (default: configs/quickstart.yml dataset_type=synthetic)")
  args = parser.parse_args(argv)
  base = args.config or DEFAULT_CONFIG
  overrides = {"plain": [], "mhc": [f"mhc_expansion_rate={args.mhc_rate}"], "lora": ["lora.enable_lora=true"]}
  variants = {name: build(base + extra) for name, extra in overrides.items()}  # plain first: it prepares the process
  # Round-robin over the variants, so a load change on a shared host hits all of them alike.
  for i in range(args.warmup_steps + args.bench_steps):
    for variant in variants.values():
      run_one_step(variant, timed=i >= args.warmup_steps)
  results = []
  for name, v in variants.items():
    losses = v["losses"]
    result = {
      "variant": name,
      "overrides": overrides[name],
      "backend": jax.default_backend(),
      "device_kind": jax.devices()[0].device_kind,
      **v["sizes"],
      "median_step_seconds": round(statistics.median(v["times"]), 5),
      "first_loss": round(losses[0], 4),
      "last_loss": round(losses[-1], 4),
      "finite": all(math.isfinite(x) for x in losses),
    }
    print(json.dumps(result), flush=True)
    results.append(result)
  plain, mhc, lora = results
  summary = {
    "mhc_step_time_ratio": round(mhc["median_step_seconds"] / plain["median_step_seconds"], 3),
    "mhc_compile_time_ratio": round(mhc["compile_seconds"] / plain["compile_seconds"], 3),
    "mhc_extra_temp_bytes": mhc["temp_bytes"] - plain["temp_bytes"],
    "lora_step_time_ratio": round(lora["median_step_seconds"] / plain["median_step_seconds"], 3),
    "lora_optimizer_state_ratio": round(lora["optimizer_state_bytes"] / plain["optimizer_state_bytes"], 5),
    "lora_checkpoint_param_ratio": round(lora["checkpointed_param_bytes"] / plain["checkpointed_param_bytes"], 5),
  }
  print(json.dumps(summary), flush=True)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
