"""Quantized matmuls against bf16 on this host: `python benchmarks/quantized_matmul.py [--repeats N]` prints one JSON
line per shape and a summary line.

Shapes: the quickstart's products (1,024 tokens per step x emb 384: the attention projections 384 -> 384, the MLP's
384 -> 1024 and 1024 -> 384) and a square 4096 x 4096 x 4096. For each, jitted on one device:

- bf16: x . w in bf16 with float32 accumulation (what the unquantized layers run, maxtext.layers.matmul);
- int8_dot: the bare int8 x int8 -> int32 dot of already quantized operands;
- int8_serving: a stored int8 kernel (maxtext.layers.quantization.stored_einsum): activations quantized per token,
  the int8 dot, both scales applied;
- int8_training: the training product (quantization.einsum): both operands quantized per channel every call;
- fp8_training: the same in e4m3.

The variants are timed interleaved (one call of each, repeated) and each keeps its best time, so a shared host's
noise reaches them alike; ratios are bf16 time / variant time (> 1: faster than bf16). The summary names the CPU's
int8 instructions from /proc/cpuinfo (amx_int8: AMX tiles; avx512_vnni / avx_vnni: int8 dot-product instructions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

QUICKSTART = {"attention 384x384": (1024, 384, 384), "mlp in 384x1024": (1024, 384, 1024), "mlp out 1024x384": (1024, 1024, 384)}
SQUARE = {"square 4096": (4096, 4096, 4096)}
INT8_FLAGS = ("amx_int8", "amx_bf16", "avx512_vnni", "avx_vnni", "avx512_bf16")


def cpu_flags() -> list[str]:
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
  except OSError:
    return []
  return [flag for flag in INT8_FLAGS if flag in flags]


def main(argv: list[str]) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--repeats", type=int, default=20, help="interleaved rounds per shape (each variant keeps its best)")
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np

  from maxtext.layers import quantization
  from maxtext.platform import choose_platform

  choose_platform()
  int8 = quantization.Recipe("int8", "int8", "int8", None)
  fp8 = quantization.Recipe("fp8", "e4m3", "e4m3", "e5m2")
  spec = "ab,bc->ac"
  rows = []
  for name, (m, k, n) in {**QUICKSTART, **SQUARE}.items():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), jnp.bfloat16)
    values, scale = quantization.quantize_kernel(w, 1, int8)
    qx = jnp.asarray(rng.integers(-127, 128, size=(m, k)), jnp.int8)
    variants = {
      "bf16": (jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), (x, w)),
      "int8_dot": (jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32)), (qx, values)),
      "int8_serving": (jax.jit(lambda x, v, s: quantization.stored_einsum(spec, x, v, s, int8, jnp.bfloat16)), (x, values, scale)),
      "int8_training": (jax.jit(lambda x, w: quantization.einsum(spec, x, w, int8, jnp.bfloat16)), (x, w)),
      "fp8_training": (jax.jit(lambda x, w: quantization.einsum(spec, x, w, fp8, jnp.bfloat16)), (x, w)),
    }
    best = {}
    for key, (fn, inputs) in variants.items():
      jax.block_until_ready(fn(*inputs))  # compile
      best[key] = float("inf")
    for _ in range(args.repeats):
      for key, (fn, inputs) in variants.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        best[key] = min(best[key], time.perf_counter() - start)
    flops = 2 * m * k * n
    row = {"shape": name, "m": m, "k": k, "n": n, "device": jax.devices()[0].device_kind}
    row.update({f"{key}_ms": round(t * 1e3, 3) for key, t in best.items()})
    row.update({f"{key}_tflops": round(flops / t / 1e12, 3) for key, t in best.items()})
    row.update({f"{key}_speed_vs_bf16": round(best["bf16"] / t, 3) for key, t in best.items() if key != "bf16"})
    print(json.dumps(row), flush=True)
    rows.append(row)
  faster = [r["shape"] for r in rows if r["int8_dot_speed_vs_bf16"] > 1]
  summary = {
    "cpu_int8_flags": cpu_flags(),
    "int8_dot_faster_than_bf16_on": faster,
    "verdict": f"the bare int8 dot beats bf16 on {len(faster)} of {len(rows)} shapes" if faster else "int8 is not faster than bf16 on this host",
  }
  print(json.dumps(summary), flush=True)
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
