"""Data-only benchmark: tokens/s the input pipeline produces (default: the quickstart config, packed), one JSON line.

  python benchmarks/data_throughput.py [configs/quickstart.yml] [key=value ...] [--batches N]

Measures global batches (host pipeline + assembly into sharded jax.Arrays), after a warm-up batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from maxtext import mesh as mesh_lib
from maxtext.config import load
from maxtext.data import create_iterator
from maxtext.errors import cli_main


@cli_main
def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("config", nargs="*", default=["configs/quickstart.yml"], help="YAML file then key=value overrides")
  parser.add_argument("--batches", type=int, default=200, help="batches to time after the warm-up batch")
  args = parser.parse_args(argv)
  overrides = args.config if args.config and args.config[0].endswith((".yml", ".yaml")) else ["configs/quickstart.yml", *args.config]
  config = load(overrides)
  mesh = mesh_lib.create(config)
  start = time.perf_counter()
  it = create_iterator(config, mesh, "train")
  setup_s = time.perf_counter() - start
  jax.block_until_ready(next(it))  # warm-up
  real = padded = 0
  start = time.perf_counter()
  for _ in range(args.batches):
    batch = next(it)
    seg = np.asarray(batch["inputs_segmentation"])
    real += int((seg > 0).sum())
    padded += seg.size
  seconds = time.perf_counter() - start
  print(
    json.dumps(
      {
        "benchmark": "data_throughput",
        "dataset_type": config.dataset_type,
        "packing": config.packing,
        "global_batch": config.global_batch_size_to_train_on,
        "max_target_length": config.max_target_length,
        "batches": args.batches,
        "tokens_per_s": round(real / seconds),
        "row_tokens_per_s": round(padded / seconds),
        "fill": round(real / padded, 4),
        "ms_per_batch": round(1000 * seconds / args.batches, 3),
        "setup_s": round(setup_s, 2),
      }
    ),
    flush=True,
  )
  getattr(it, "close", lambda: None)()


if __name__ == "__main__":
  main(sys.argv[1:])
