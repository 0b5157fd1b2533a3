"""Gradients of quantized training on every family: `python benchmarks/quantized_gradients.py [--modes int8 fp8 ...]`
prints one JSON line per (family, mode) and a summary.

For each decoder family (tiny random models: dense, sliding-window, gemma2's soft caps, qwen3's QK norm, the MoE
families mixtral and qwen3_moe, deepseek with MLA, shared experts, group-limited routing and MTP) and each mode
(int8, fp8, fp8_full, and QLoRA: LoRA on an int8 or int4 base), the loss gradient of one batch is computed twice,
each time from a model built anew from the same seed. Reported: whether every gradient is finite, whether the two
are bitwise equal, the number of quantized products in the traced forward pass, and the loss against the
unquantized model's.
"""

from __future__ import annotations

import argparse
import json
import sys

BASE = dict(base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, base_mlp_dim=64, base_num_decoder_layers=2, head_dim=8, vocab_size=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=16)
FAMILIES = {
  "llama2": {},
  "mistral": dict(decoder_block="mistral", sliding_window_size=3),
  "gemma2": dict(decoder_block="gemma2", sliding_window_size=3, attn_logits_soft_cap=50.0, final_logits_soft_cap=30.0, mlp_activations=["gelu", "linear"]),
  "qwen3": dict(decoder_block="qwen3", use_qk_norm=True, logits_via_embedding=True),
  "mixtral": dict(decoder_block="mixtral", **MOE),
  "mixtral_capacity": dict(decoder_block="mixtral", capacity_factor=1.5, **MOE),
  "qwen3_moe": dict(decoder_block="qwen3_moe", use_qk_norm=True, **MOE),
  "deepseek": dict(
    decoder_block="deepseek",
    base_num_decoder_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    base_moe_mlp_dim=8,
    shared_experts=1,
    first_num_dense_layers=1,
    routed_score_func="sigmoid",
    routed_bias=True,
    n_routing_groups=4,
    topk_routing_group=2,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=6,
    rope_type="yarn",
    rope_factor=4,
    original_max_position_embeddings=4,
    mtp_num_layers=1,
  ),
}
MODES = {
  "int8": dict(quantization="int8"),
  "fp8": dict(quantization="fp8"),
  "fp8_full": dict(quantization="fp8_full", weight_quantization_calibration_method="absmax,0.95"),
  "qlora_int8": dict(quantization="int8", lora={"enable_lora": True, "lora_rank": 4, "lora_module_path": ".*(attention|mlp)/.*"}),
  "qlora_int4w": dict(quantization="int4w", lora={"enable_lora": True, "lora_rank": 4, "lora_module_path": ".*(attention|mlp)/.*"}),
}


def main(argv: list[str]) -> list[dict]:
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
  from maxtext.train import loss as loss_lib

  choose_platform()

  def batch(config):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, config.vocab_size, size=(2, 16)), jnp.int32)
    ones, positions = jnp.ones((2, 16), jnp.int32), jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    return dict(
      inputs=tokens, targets=jnp.roll(tokens, -1, 1), inputs_position=positions, targets_position=positions, inputs_segmentation=ones, targets_segmentation=ones
    )

  def loss_fn(config, data):
    trained = LoRAParam if config.lora.enable_lora else nnx.Param
    graphdef, params, rest = nnx.split(models.build(config), trained, ...)

    def loss(params):
      sums = loss_lib.loss_sums(nnx.merge(graphdef, params, rest), data, config)
      return (sums.xent + sums.aux) / sums.weights

    return loss, params

  def quantized_products(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ("dot_general", "ragged_dot_general") and all(v.aval.dtype.itemsize == 1 for v in eqn.invars[:2]):
        n += 1
      for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
          sub = v if hasattr(v, "eqns") else getattr(v, "jaxpr", None)
          if hasattr(sub, "eqns"):
            n += quantized_products(sub)
    return n

  rows = []
  for family in args.families:
    float_config = from_overrides(num_devices=1, dtype="float32", **BASE, **FAMILIES[family])
    data = batch(float_config)
    float_loss = float(jax.jit(loss_fn(float_config, data)[0])(loss_fn(float_config, data)[1]))
    for mode in args.modes:
      config = from_overrides(num_devices=1, dtype="float32", **BASE, **FAMILIES[family], **MODES[mode])
      loss, params = loss_fn(config, data)
      grad = jax.jit(jax.value_and_grad(loss))
      value, grads = grad(params)
      _, again = grad(loss_fn(config, data)[1])
      leaves, leaves_again = jax.tree.leaves(grads), jax.tree.leaves(again)
      row = {
        "family": family,
        "mode": mode,
        "finite": bool(np.isfinite(float(value))) and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves),
        "bitwise_reproducible": all(np.array_equal(a, b) for a, b in zip(leaves, leaves_again)),
        "quantized_products": quantized_products(jax.make_jaxpr(loss)(params).jaxpr),
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
