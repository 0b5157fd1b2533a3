"""XLA_FLAGS for the tests' JAX processes, in-process and subprocess alike.

Every test program compiles with XLA's backend (LLVM) optimisations off (`FAST_COMPILE_FLAGS`): the same HLO passes,
sharding and collectives, cheaper machine code, at about 60% of the CPU compile time (a tiny model's forward, backward
and update are compile-bound on CPU; tests/test_qwen3_5.py: 188 -> 115 CPU s). XLA:CPU's older loop emitters replace
its fusion emitters (`--xla_cpu_use_fusion_emitters=false`): the tiny train step of tests/test_train_helpers.py
compiles in 1.4 CPU s instead of 4.2, its init in 1.2 instead of 2.1. Floats may differ from optimised code
in the last bits, never between two runs with the same flags. The tests prove what a program computes, not how fast
its machine code runs; benchmarks time compiled code and never take these flags.

The flags are the same in the test process (tests/conftest.py) and in every subprocess a test starts, so a run in a
subprocess and one in-process compile the same executables: the bit-exact comparisons between them (resume,
multi-process against one process) depend on it. JAX's persistent compilation cache keys on the flags, so cached
programs are never mixed across flag sets.
"""

from __future__ import annotations

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
# XLA's defaults, for a program whose output is compared with bytes stored from optimised code (golden logits):
# `jax.jit(f).lower(...).compile(OPTIMISED_COMPILE)` overrides the fast flags for that one program.
OPTIMISED_COMPILE = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False, "xla_cpu_use_fusion_emitters": True}


def xla_flags(devices: int | None = None, *extra: str) -> str:
  """XLA_FLAGS with the fast-compile flags; `devices` simulated CPU devices (None: XLA's default of 1, not forced,
  as on a user's machine); `extra` flags appended."""
  forced = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
  return " ".join([*forced, FAST_COMPILE_FLAGS, *extra])
