"""Gradients of quantized training on every family: `python benchmarks/quantized_gradients.py [--modes int8 fp8 ...]`
prints one JSON line per (family, mode) and a summary.

For each decoder family (the tiny random models of tests/test_quantization.py: dense, sliding-window, gemma2's soft
caps, qwen3's QK norm, mixtral (dropless and with a capacity), qwen3_moe, deepseek with MLA, shared experts,
group-limited routing and MTP) and each mode
(int8, fp8, fp8_full, and QLoRA: LoRA on an int8 or int4 base), the loss gradient of one batch is computed twice,
each time from a model built anew from the same seed. Reported: whether every gradient is finite, whether the two
are bitwise equal, the number of quantized products in the traced forward pass, and the loss against the
unquantized model's.
"""

from __future__ import annotations

import argparse
import json
import sys

from maxtext.train import loss as loss_lib

MODES = {
  "int8": dict(quantization="int8"),
  "fp8": dict(quantization="fp8"),
  "fp8_full": dict(quantization="fp8_full", weight_quantization_calibration_method="absmax,0.95"),
  "qlora_int8": dict(quantization="int8", lora={"enable_lora": True, "lora_rank": 4}),
  "qlora_int4w": dict(quantization="int4w", lora={"enable_lora": True, "lora_rank": 4}),
}


def main(argv: list[str]) -> list[dict]:
  from tests.test_quantization import FAMILIES

  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
  parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from maxtext import models
  from maxtext.config import from_overrides
  from maxtext.layers.lora import LoRAParam
  from maxtext.platform import choose_platform
  from tests.test_quantization import _batch, count_dots

  choose_platform()

  def loss_fn(config, data):
    graphdef, params, rest = nnx.split(models.build(config), LoRAParam if config.lora.enable_lora else nnx.Param, ...)

    def loss(params):
      sums = loss_lib.loss_sums(nnx.merge(graphdef, params, rest), data, config)
      return (sums.xent + sums.aux) / sums.weights

    return loss, params

  rows = []
  for family in args.families:
    float_config = from_overrides(**{**FAMILIES[family], "num_devices": 1, "dtype": "float32"})
    data = _batch(float_config, seq=16)
    float_loss = float(jax.jit(loss_fn(float_config, data)[0])(loss_fn(float_config, data)[1]))
    for mode in args.modes:
      config = from_overrides(**{**FAMILIES[family], "num_devices": 1, "dtype": "float32", **MODES[mode]})
      loss, params = loss_fn(config, data)
      grad = jax.jit(jax.value_and_grad(loss))
      value, grads = grad(params)
      _, again = grad(loss_fn(config, data)[1])
      leaves, leaves_again = jax.tree.leaves(grads), jax.tree.leaves(again)
      traced = jax.make_jaxpr(loss)(params).jaxpr
      row = {
        "family": family,
        "mode": mode,
        "finite": bool(np.isfinite(float(value))) and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves),
        "bitwise_reproducible": all(np.array_equal(a, b) for a, b in zip(leaves, leaves_again)),
        "quantized_products": sum(count_dots(traced, dt) for dt in (jnp.int8, jnp.float8_e4m3fn)),
        "gradient_arrays": len(leaves),
        "loss": round(float(value), 5),
        "float_loss": round(float_loss, 5),
      }
      print(json.dumps(row), flush=True)
      rows.append(row)
  print(json.dumps({"all_finite": all(r["finite"] for r in rows), "all_bitwise_reproducible": all(r["bitwise_reproducible"] for r in rows), "runs": len(rows)}))
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
