"""Hybrid linear attention vs full attention: `python benchmarks/hybrid_attention.py [--lengths 4096,16384] [--rounds 5] [key=value ...]`.

Times the train step of a tiny Qwen3-Next-shaped model (decoder_block qwen3_next, per 4 layers 3 Gated DeltaNet
layers then one gated full-attention layer) against the same model with full attention in every layer
(inhomogeneous_layer_cycle_interval=1: the same parameters but the linear layers'), at each length. Both steps are
compiled (benchmarks/compiled_step.py, as train compiles them) and warmed up, then timed alternately, one step of
each per round, so that a shared machine's load falls on both alike. Prints one JSON line per length (each model's
median step, the ratio of the medians, the median of the rounds' ratios, this machine's bf16 matmul throughput
before and after), then the KV-cache size line of each model (the Gated DeltaNet layers' decode state does not grow
with the length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax

TINY_QWEN3_NEXT = [
  "decoder_block=qwen3_next",
  "run_name=hybrid",
  "base_output_directory=/tmp/hybrid_attention",
  "dataset_type=synthetic",
  "enable_checkpointing=false",
  "base_emb_dim=256",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "head_dim=64",
  "base_mlp_dim=512",
  "base_num_decoder_layers=4",
  "vocab_size=1024",
  "per_device_batch_size=1",
  "inhomogeneous_layer_cycle_interval=4",
  "partial_rotary_factor=0.25",
  "use_qk_norm=true",
  "gdn_num_key_heads=2",
  "gdn_num_value_heads=4",
  "gdn_key_head_dim=64",
  "gdn_value_head_dim=64",
]
MODELS = {"hybrid": [], "full_attention": ["inhomogeneous_layer_cycle_interval=1"]}


def alternate(configs: dict, warmup_steps: int, rounds: int) -> dict[str, list[float]]:
  """Compile each config's train step, run warmup_steps of each, then `rounds` rounds of one synchronised step of
  each in turn -> the step seconds of each config, by name."""
  from compiled_step import compile_train_step

  from maxtext.train.loop import create_data_iterator

  runs = {}
  for name, config in configs.items():
    step = compile_train_step(config)
    with jax.set_mesh(step.mesh):
      runs[name] = [step, step.init_state(), create_data_iterator(step.config, step.mesh, "train")]
  seconds = {name: [] for name in configs}
  for i in range(warmup_steps + rounds):
    for name, run in runs.items():
      step, state, data = run
      with jax.set_mesh(step.mesh):
        batch = jax.block_until_ready(next(data))
        start = time.perf_counter()
        run[1], metrics = step.compiled(state, batch)
        jax.block_until_ready(metrics)
      if i >= warmup_steps:
        seconds[name].append(time.perf_counter() - start)
  return seconds


def main(argv: list[str]) -> dict:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--lengths", default="4096,16384", help="comma-separated max_target_length values")
  parser.add_argument("--warmup_steps", type=int, default=1)
  parser.add_argument("--rounds", type=int, default=5, help="alternating timed steps of each model")
  parser.add_argument("overrides", nargs="*", help="key=value overrides of the tiny model")
  args = parser.parse_args(argv)
  sys.path.insert(0, __file__.rsplit("/", 1)[0])

  from maxtext.config import load
  from maxtext.inference import cache_layout
  from maxtext.process import prepare
  from maxtext.train import perf

  ratios, lines = {}, {}
  for length in (int(n) for n in args.lengths.split(",")):
    configs = {
      name: load(["configs/base.yml", *TINY_QWEN3_NEXT, f"max_target_length={length}", *extra, *args.overrides], devices=prepare)
      for name, extra in MODELS.items()
    }
    matmul_before = perf.measure_matmul_tflops(0)
    seconds = alternate(configs, args.warmup_steps, args.rounds)
    matmul_after = perf.measure_matmul_tflops(0)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    ratios[length] = round(median["hybrid"] / median["full_attention"], 3)
    per_round = statistics.median(h / f for h, f in zip(seconds["hybrid"], seconds["full_attention"], strict=True))
    result = {
      "max_target_length": length,
      "hybrid_over_full_attention": ratios[length],
      "median_of_round_ratios": round(per_round, 3),
      **{f"{name}_median_step_seconds": round(m, 4) for name, m in median.items()},
      "rounds": args.rounds,
      "measured_bf16_matmul_tflops_before_after": [round(matmul_before, 4), round(matmul_after, 4)],
    }
    print(json.dumps(result), flush=True)
    for name, config in configs.items():
      lines[(name, length)] = cache_layout.describe(config, 1, cache_layout.layout(config, length))
  for (name, length), line in lines.items():
    print(f"{name} at {length}: {line}")
  return ratios


if __name__ == "__main__":
  main(sys.argv[1:])
