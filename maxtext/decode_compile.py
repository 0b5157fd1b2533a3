"""`python -m maxtext.decode_compile configs/base.yml compile_topology=v5p-64 key=value ...`

Compiles one decode step for a TPU topology on a CPU-only host (needs libtpu): batch per_device_batch_size x devices,
a KV cache of max_target_length tokens per row. Prints the KV cache size, the per-device memory against the chip's
HBM and one JSON line. Exit 0: fits; 3: does not fit; 2: user error.
"""

from __future__ import annotations

import os
import sys

from maxtext.cli import config_usage, entry

USAGE = config_usage(
  "maxtext.decode_compile",
  "Compile one decode step for a TPU topology on this host (no TPU needed; needs libtpu), print the KV cache size,\n"
  "the per-device memory against the chip's HBM and one JSON line. Exit 0: fits; 3: does not fit.",
  "python -m maxtext.decode_compile configs/base.yml model_name=deepseek3-671b compile_topology=v5p-64 per_device_batch_size=0.25 "
  "max_target_length=32768 weight_dtype=bfloat16 ici_fsdp_parallelism=8 ici_tensor_parallelism=4",
  "compile keys: compile_topology=v5p-64 (names: docs/tpu.md)  compile_topology_num_slices=N  mla_naive_kvcache=true|false",
)


@entry(USAGE)
def main(argv: list[str]) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only TPU devices need no local accelerator
  from maxtext.aot import memory
  from maxtext.aot.decode import compile_decode_step
  from maxtext.aot.devices import load_for_topology

  config, chip = load_for_topology(argv, "v5p-64")
  print(f"compiling a decode step of {config.model_name} for {config.compile_topology} ({config.num_devices} devices)", flush=True)
  result = compile_decode_step(config)
  print(result.cache_line)
  print(f"compiled in {result.compile_seconds:.1f}s; batch {result.batch}, KV cache {memory.gib(result.cache_bytes_per_device)} GiB per device")
  memory.print_report(result.memory, result.summary(), chip)


if __name__ == "__main__":
  main(sys.argv[1:])
