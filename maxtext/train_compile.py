"""`python -m maxtext.train_compile configs/base.yml compile_topology=v5p-8 [compile_topology_num_slices=2] key=value ...`

Compiles the train step of maxtext.train for a TPU topology on a CPU-only host (needs libtpu), prints the
per-device memory against the chip's HBM, and ends with one JSON line. Exit 0: fits; 3: does not fit; 2: user error.
"""

from __future__ import annotations

import os
import sys

from maxtext.cli import config_usage, entry

USAGE = config_usage(
  "maxtext.train_compile",
  "Compile the train step for a TPU topology on this host (no TPU needed; needs libtpu, from the `tpu` or `test`\n"
  "extra), print the per-device memory against the chip's HBM and one JSON line. Exit 0: fits; 3: does not fit.",
  "python -m maxtext.train_compile configs/base.yml model_name=llama3.1-8b compile_topology=v5p-8 per_device_batch_size=2",
  "compile keys: compile_topology=v5p-8 (names: docs/tpu.md)  compile_topology_num_slices=N  compiled_trainstep_file=PATH",
)


@entry(USAGE)
def main(argv: list[str]) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only TPU devices need no local accelerator
  from maxtext.aot import compile as aot_compile
  from maxtext.aot import executable, memory, remat_auto
  from maxtext.aot.devices import load_for_topology

  config, chip = load_for_topology(argv, "v5p-8")
  where = f"{config.compile_topology} x {config.compile_topology_num_slices} slice(s) ({config.num_devices} devices)"
  print(f"compiling the train step of {config.model_name} for {where}: ici {config.ici_parallelism}, dcn {config.dcn_parallelism}", flush=True)
  result = aot_compile.compile_for_topology(config, log=lambda line: print(line, flush=True))
  print(f"remat_policy: {result.config.remat_policy}")
  print(remat_auto.saved_input(result.config.decoder_layer_input == "offload", result.config.decoder_layer_input, result.choice))
  print(
    f"compiled in {result.compile_seconds:.1f}s; model TFLOPs per step {result.tflops_per_step:.2f} ({result.tflops_per_step / config.num_devices:.3f} per device)"
  )
  print(result.state_line(config))
  if config.quantization == "int8":
    print(f"compiled executable: {result.int8_products} int8 x int8 matmul instructions (dot/convolution with two s8 operands)")
  memory.print_report(result.memory, result.summary(), chip)
  if config.compiled_trainstep_file:
    executable.save(config.compiled_trainstep_file, result.compiled, result.config, result.devices)  # auto keys resolved
    print(f"saved the compiled train step to {config.compiled_trainstep_file}", file=sys.stderr)


if __name__ == "__main__":
  main(sys.argv[1:])
