"""Hybrid linear attention vs full attention: `python benchmarks/hybrid_attention.py [--lengths 4096,16384] [key=value ...]`.

Times the train step (benchmarks/train_throughput.py's measure) of a tiny Qwen3-Next-shaped model (decoder_block
qwen3_next, per 4 layers 3 Gated DeltaNet layers then one gated full-attention layer) against the same model with
full attention in every layer (inhomogeneous_layer_cycle_interval=1: the same parameters but the linear layers'),
at each length; prints one JSON line per run, then the ratio per length and the KV-cache size line of each model
(the Gated DeltaNet layers' decode state does not grow with the length).
"""

from __future__ import annotations

import argparse
import json
import sys

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


def main(argv: list[str]) -> dict:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--lengths", default="4096,16384", help="comma-separated max_target_length values")
  parser.add_argument("--warmup_steps", type=int, default=1)
  parser.add_argument("--bench_steps", type=int, default=3)
  parser.add_argument("overrides", nargs="*", help="key=value overrides of the tiny model")
  args = parser.parse_args(argv)
  sys.path.insert(0, __file__.rsplit("/", 1)[0])
  from train_throughput import measure

  from maxtext.config import load
  from maxtext.inference import cache_layout
  from maxtext.process import prepare
  from maxtext.train import perf

  matmul = perf.measure_matmul_tflops(0)
  ratios, lines = {}, {}
  for length in (int(n) for n in args.lengths.split(",")):
    seconds = {}
    for name, extra in MODELS.items():
      config = load(["configs/base.yml", *TINY_QWEN3_NEXT, f"max_target_length={length}", *extra, *args.overrides], devices=prepare)
      result = measure(config, args.warmup_steps, args.bench_steps, matmul, moe_share=False)
      seconds[name] = result["median_step_seconds"]
      print(json.dumps({"model": name, "max_target_length": length, **result}), flush=True)
      lines[(name, length)] = cache_layout.describe(config, 1, cache_layout.layout(config, length))
    ratios[length] = round(seconds["hybrid"] / seconds["full_attention"], 3)
    print(json.dumps({"max_target_length": length, "hybrid_over_full_attention": ratios[length], **seconds}), flush=True)
  for (name, length), line in lines.items():
    print(f"{name} at {length}: {line}")
  return ratios


if __name__ == "__main__":
  main(sys.argv[1:])
