"""Quantization (qwix): recipes and their config errors, int8 x int8 -> int32 products, every projection quantized with
finite, bitwise-reproducible gradients per family, QLoRA's quantized frozen kernels, quantized checkpoints and decoding."""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

from maxtext import models, platform
from maxtext.config import ConfigError, from_overrides
from maxtext.layers import quantization
from maxtext.train import loss as loss_lib
from tests.test_models import FAMILY_OVERRIDES, TINY
from tests.test_moe_families import DEEPSEEK, GEMMA3, GPT_OSS, QWEN3_MOE

FAMILIES = {
  **{name: dict(TINY, decoder_block=name, **overrides) for name, overrides in FAMILY_OVERRIDES.items()},
  "mixtral_capacity": dict(TINY, decoder_block="mixtral", **FAMILY_OVERRIDES["mixtral"], capacity_factor=1.5),
  "qwen3_moe": dict(QWEN3_MOE, dtype="float32"),
  "deepseek": dict(DEEPSEEK, mtp_num_layers=1, megablox=False),  # the sorted (grouped) dispatch; the other MoE families' shapes take CPU's dense one
  "gpt_oss": GPT_OSS,  # biased attention and experts, sinks
  "gemma3": GEMMA3,
}
# Quantized products per forward pass: every attention (MLA: wq_a, wq_b, wkv_a, wkv_b, out) and MLP projection
# (gated: wi_0, wi_1, wo) and the routed experts (3 grouped or batched matmuls); a scanned stack traces its layer once.
# Not quantized: the router, attention's own products, the output head, mHC and the MTP module.
QUANTIZED_DOTS = {
  "llama2": 7,
  "mistral": 7,
  "mixtral": 7,
  "mixtral_capacity": 7,
  "qwen3": 7,
  "gemma2": 7,
  "qwen3_moe": 7,
  "deepseek": 19,
  "gpt_oss": 7,
  "gemma3": 7,
  "qwen2": 7,
  "olmo3": 7,
}


def _batch(config, rows: int = 2, seq: int = 8) -> dict[str, jax.Array]:
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, config.vocab_size, size=(rows, seq)), jnp.int32)
  ones = jnp.ones((rows, seq), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq))
  return dict(
    inputs=tokens, targets=jnp.roll(tokens, -1, 1), inputs_position=positions, targets_position=positions, inputs_segmentation=ones, targets_segmentation=ones
  )


def _subjaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if hasattr(v, "eqns"):
        yield v
      elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
        yield v.jaxpr


def count_dots(jaxpr, dtype) -> int:
  """dot_general / ragged_dot_general equations with both operands in dtype, nested jaxprs included."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "ragged_dot_general") and all(v.aval.dtype == dtype for v in eqn.invars[:2]):
      n += 1
    n += sum(count_dots(sub, dtype) for sub in _subjaxprs(eqn))
  return n


def _loss(config, batch, model):
  """(loss of the model's parameters, its parameters); the other variables (routing biases) are traced as inputs too."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rest=rest):
    sums = loss_lib.loss_sums(nnx.merge(graphdef, params, rest), batch, config)
    return (sums.xent + sums.aux) / sums.weights

  return loss, params


@pytest.mark.parametrize("family", [*FAMILIES, "llama2+logits"])
def test_every_projection_is_quantized(family):
  """Traced only (abstract parameters): the int8 x int8 products of each family's forward pass (the output head's
  only with quantize_logits_proj)."""
  name, _, logits = family.partition("+")
  config = from_overrides(**{**FAMILIES[name], "num_devices": 1, "quantization": "int8", "quantize_logits_proj": bool(logits)})
  model = models.abstract_model(config)
  loss, params = _loss(config, _batch(config), model)
  assert count_dots(jax.make_jaxpr(loss)(params, nnx.state(model, nnx.Not(nnx.Param))).jaxpr, jnp.int8) == QUANTIZED_DOTS[name] + bool(logits)


def test_fp8_gradients_finite_and_bitwise_reproducible():
  """fp8 quantizes the gradients too (e5m2), through MLA, the routed experts' grouped matmuls and shared experts (int8's
  straight-through gradients: the QLoRA step below and benchmarks/quantized_gradients.py for every family)."""
  slim = dict(base_num_decoder_layers=2, mtp_num_layers=0)  # one dense and one MoE layer
  config = from_overrides(**{**FAMILIES["deepseek"], **slim, "num_devices": 1, "quantization": "fp8"})
  batch = _batch(config)
  loss, params = _loss(config, batch, models.build(config))
  grad = jax.jit(jax.value_and_grad(loss))
  value, grads = grad(params)
  _, again = grad(_loss(config, batch, models.build(config))[1])  # a second model from the same seed
  assert np.isfinite(float(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(again)))


def test_int8_product_is_an_int8_dot_with_per_channel_scales():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 64)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(64, 4, 8)), jnp.float32)
  r = quantization.Recipe("int8", "int8", "int8", None)
  spec = quantization.trailing_spec(3, 1, 2)
  y = np.asarray(quantization.einsum(spec, x, w, r, jnp.float32))
  qx = qwix.quantize(x, jnp.int8, channelwise_axes=[0, 1])  # one scale per token, absmax / 127.5
  qw = qwix.quantize(w, jnp.int8, channelwise_axes=[1, 2])  # one per output channel
  assert qx.scale.shape == (3, 5, 1) and qw.scale.shape == (1, 4, 8)
  exact = np.einsum("abc,cde->abde", np.asarray(qx.qvalue, np.int64), np.asarray(qw.qvalue, np.int64)) * np.asarray(qx.scale)[..., None] * np.asarray(qw.scale)
  np.testing.assert_allclose(y, exact, rtol=1e-5)
  np.testing.assert_allclose(y, np.einsum("abc,cde->abde", x, w), atol=0.05 * float(np.abs(y).max()))
  hlo = jax.jit(lambda x, w: quantization.einsum(spec, x, w, r, jnp.bfloat16)).lower(x, w).as_text()
  assert re.search(r"stablehlo\.dot_general.*tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\) -> tensor<[0-9x]+xi32>", hlo)


def test_stored_int8_product_rounds_once_like_the_float_product():
  """Decoding's product on a stored int8 kernel, in bfloat16: the exact w8a8 result (int8 values from float32
  quotients, float32 scales) rounded once to bfloat16, as the float product rounds its float32 accumulator once.
  Scales cast to bfloat16 (weight scales off by up to 2^-9, the int32 accumulator rounded before scaling) or
  activations divided in bfloat16 (double rounding) miss it by several bfloat16 steps."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_t(3, size=(64, 512)), jnp.bfloat16)  # heavy tails, like an MLP's activations
  w = jnp.asarray(rng.normal(size=(512, 64)) * np.linspace(0.1, 3.0, 64), jnp.float32)
  r = quantization.Recipe("int8", "int8", "int8", None, stored=True)
  values, scale = quantization.quantize_kernel(w, 1, r)
  y = np.asarray(quantization.stored_einsum("ab,bc->ac", x, values, scale, r, jnp.bfloat16), np.float64)
  xf = np.asarray(x, np.float64)
  sx = np.abs(xf).max(axis=1, keepdims=True) / 127.5
  qx = np.clip(np.round(xf / sx), -128, 127)
  exact = (qx @ np.asarray(values, np.float64)) * sx * np.asarray(scale, np.float64)
  assert np.abs(y - exact).max() <= 2.0**-8 * np.abs(exact).max()


def test_recipes_and_their_config_errors():
  base = dict(TINY, num_devices=1)
  fp8 = quantization.recipe(from_overrides(**base, quantization="fp8_full", bwd_quantization_calibration_method="fixed,-1,1"))
  assert (fp8.weight, fp8.activation, fp8.gradient, fp8.grad_calibration, fp8.stored) == ("e4m3", "e4m3", "e5m2", "fixed,-1,1", False)
  qlora = quantization.recipe(from_overrides(**base, quantization="int4w", lora={"enable_lora": True}))
  assert (qlora.weight, qlora.activation, qlora.stored) == ("int4", None, True)
  assert quantization.recipe(from_overrides(**base)) is None
  moe_keys = dict(FAMILIES["mixtral"], num_devices=1, num_experts=16)  # TPU's default dispatch: megablox, or tokamax by its key
  for keys in ({}, {"use_tokamax_gmm": True}):
    keyed = from_overrides(**moe_keys, **keys)
    assert platform.moe_dispatch(keyed, "tpu") in ("megablox", "tokamax")  # their kernels take no quantized operands:
    assert platform.moe_dispatch(keyed.model_copy(update={"quantization": "int8"}), "tpu") == "ragged_dot"
  errors = {
    "applies to quantization=fp8_full": dict(quantization="fp8", act_quantization_calibration_method="absmax,0.9"),
    "invalid value for 'weight_quantization_calibration_method'": dict(quantization="fp8_full", weight_quantization_calibration_method="percentile"),
    "keeps gradients in": dict(quantization="int8", quantization_local_shard_count=2),
    "must divide max_target_length": dict(quantization="fp8", quantization_local_shard_count=3, max_target_length=16),
    "quantize_logits_proj=true quantizes": dict(quantization="int4w", quantize_logits_proj=True),
    "needs kv_quant_axis": dict(quantize_kvcache=True, kv_quant_axis=""),
    "two values per byte along head_dim": dict(quantize_kvcache=True, kv_quant_dtype="int4", head_dim=15),
    "checkpoint_is_quantized=true loads": dict(quantization="int8", checkpoint_is_quantized=True),
    "save_quantized_params_path writes": dict(save_quantized_params_path="/tmp/x"),
  }
  for message, overrides in errors.items():
    with pytest.raises(ConfigError, match=re.escape(message)):
      from_overrides(**{**base, **overrides})


def test_fp8_needs_fp8_units():
  r = quantization.Recipe("fp8", "e4m3", "e4m3", "e5m2")
  gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
  with pytest.raises(ConfigError, match=r"needs fp8 matmul units \(NVIDIA compute capability 8.9\+.*A100.* has 8.0"):
    quantization.check_devices(r, [gpu])
  quantization.check_devices(r, [types.SimpleNamespace(platform="gpu", device_kind="H100", compute_capability="9.0")])
  quantization.check_devices(dataclasses.replace(r, mode="int8", weight="int8", activation="int8", gradient=None), [gpu])


def _kernel_bytes(tree) -> int:
  """Bytes of the decoder layers' kernels."""
  leaves = [v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0] if p[0].key == "layers" and p[-2].key == "kernel"]
  return sum(v.size * v.dtype.itemsize for v in leaves)


@pytest.fixture(scope="module")
def qlora():
  """(setup, one train step's (before, after) states) of an int8 QLoRA tiny llama, and the float LoRA setup."""
  from maxtext import mesh as mesh_lib
  from maxtext.train import setup as setup_lib

  def build(**overrides):
    lora = {"enable_lora": True, "lora_rank": 4}
    config = from_overrides(
      **{**TINY, "num_devices": 1, "lora": lora, "max_target_length": 8, "warmup_steps_fraction": 0.0, "learning_rate": 1e-2, **overrides}
    )
    return setup_lib.build(config, mesh_lib.create(config, devices=jax.devices()[:1]))

  setup = build(quantization="int8")
  with jax.set_mesh(setup.mesh):
    before = setup.init_state()
    copy = jax.tree.map(lambda x: np.asarray(x), before)
    after, metrics = setup.jit_step(before, jax.device_put(_batch(setup.config), setup.batch_shardings))
  return setup, copy, after, metrics, build(), build(quantization="int4w")


def test_qlora_keeps_frozen_kernels_quantized_and_trains_the_adapters(qlora):
  setup, before, after, metrics, float_setup, int4_setup = qlora

  def layer_kernels(s):  # the output head's kernel stays in weight_dtype
    return [v for p, v in jax.tree_util.tree_flatten_with_path(s.abstract_state["params"])[0] if p[0].key == "layers" and p[-2].key == "kernel"]

  assert len(layer_kernels(setup)) == 7 and all(v.dtype == jnp.int8 for v in layer_kernels(setup))
  assert all(v.dtype == jnp.uint8 for v in layer_kernels(int4_setup))  # two int4 values per byte
  q8, f32, q4 = (_kernel_bytes(s.abstract_state["params"]) for s in (setup, float_setup, int4_setup))
  assert f32 == 4 * q8 == 8 * q4  # float32 -> int8 -> int4 (packed), scales counted apart
  assert jax.tree.structure(setup.abstract_state["opt_state"]) == jax.tree.structure(float_setup.abstract_state["opt_state"])  # adapters only
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  flat_before = dict(jax.tree_util.tree_flatten_with_path(before["params"])[0])
  for path, value in jax.tree_util.tree_flatten_with_path(after["params"])[0]:
    name = jax.tree_util.keystr(path)
    moved = not np.array_equal(np.asarray(value), flat_before[path])
    assert moved if "lora_b" in name else (not moved or "lora_a" in name), name  # the base is frozen (A moves by weight decay only)


def test_quantized_checkpoint_round_trip(tmp_path):
  """decode's loading steps (maxtext.inference.loading.load_model) on a float checkpoint: restored as float, quantized
  per output channel, written (save_quantized_params_path) and read back with checkpoint_is_quantized as the same
  arrays; mismatched flags or formats are one-line errors, read from the checkpoint's metadata."""
  from maxtext.convert.peft import _abstract_params
  from maxtext.inference.loading import serving_policy
  from maxtext.mesh import create
  from maxtext.train import checkpoint_files, initial_params

  base = dict(TINY, num_devices=8, dtype="bfloat16")
  float_config = from_overrides(**base)
  rng = np.random.default_rng(0)
  graphdef, abstract = nnx.split(models.abstract_model(float_config), nnx.Param)
  checkpoint_files.save_params(str(tmp_path / "float"), jax.tree.map(lambda v: rng.normal(0, 0.1, v.shape).astype(v.dtype), abstract))

  def config(**overrides):
    return from_overrides(**{**base, "quantization": "int8", "load_parameters_path": str(tmp_path / "float"), **overrides})

  c = config()
  stored = _abstract_params(c, serving_policy(c, create(c)))
  initial_params.check_base_quantization(c, c.load_parameters_path, stored)
  restored, _ = checkpoint_files.restore_some_params(c.load_parameters_path, initial_params.base_target(c, stored), "load_parameters_path")
  quantized = initial_params.quantize_restored(c, restored, stored)
  values, scale = (quantized["layers"]["mlp"]["wo"][k][...] for k in ("kernel", "kernel_scale"))
  w = np.asarray(restored["layers"]["mlp"]["wo"]["kernel"][...], np.float32)
  assert values.dtype == jnp.int8 and scale.shape == (2, 1, 32)  # [layers, mlp -> 1, embed]: per output channel
  np.testing.assert_allclose(np.asarray(values, np.float32) * np.asarray(scale), w, atol=float(np.abs(w).max()) / 254 * 1.01)
  checkpoint_files.save_params(str(tmp_path / "q8"), quantized)
  q8 = config(load_parameters_path=str(tmp_path / "q8"), checkpoint_is_quantized=True)
  initial_params.check_base_quantization(q8, q8.load_parameters_path, stored)
  again, _ = checkpoint_files.restore_some_params(q8.load_parameters_path, initial_params.base_target(q8, stored), "load_parameters_path")
  flat, flat_again = dict(nnx.to_flat_state(quantized)), dict(nnx.to_flat_state(again))
  assert flat.keys() == flat_again.keys() and all(np.array_equal(flat[k][...], flat_again[k][...]) for k in flat)

  for message, overrides in {
    "holds float kernels": dict(checkpoint_is_quantized=True),
    "set checkpoint_is_quantized=true": dict(load_parameters_path=str(tmp_path / "q8")),
    "holds layers/attention/key/kernel as int8, quantization=int4w stores int4 (two per uint8)": dict(
      load_parameters_path=str(tmp_path / "q8"), checkpoint_is_quantized=True, quantization="int4w"
    ),
  }.items():
    other = config(**overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
      initial_params.check_base_quantization(other, other.load_parameters_path, _abstract_params(other, serving_policy(other, create(other))))


@pytest.mark.parametrize("kv_dtype,axis,tolerance", [("int8", "heads_and_dkv", 0.03), ("int8", "dkv", 0.03), ("int4", "dkv", 0.4)])
def test_quantized_kv_cache_attends_like_the_float_cache(kv_dtype, axis, tolerance):
  """Prefill then one decode step over an int8/int4 cache against the same over a float cache; int8's bytes <= 0.53x."""
  from maxtext.inference import cache_layout
  from maxtext.inference.kv_cache import LayerCache

  b, s, k, g, d, slots = 2, 6, 2, 2, 32, 8
  rng = np.random.default_rng(0)
  q, kk, v = (jnp.asarray(rng.normal(size=(b, s + 1, heads, d)), jnp.float32) for heads in (k * g, k, k))
  per_head = k if axis == "dkv" else 1
  stored, packed_shape = (jnp.uint8, (b, k, slots, d // 2)) if kv_dtype == "int4" else (kv_dtype, (b, k, slots, d))  # int4: two per byte
  lengths = (jnp.zeros((b,), jnp.int32), jnp.full((b,), s, jnp.int32))
  scales = {"key_scale": jnp.ones((b, per_head, slots, 1)), "value_scale": jnp.ones((b, per_head, slots, 1))}
  caches = {
    "float": LayerCache({"key": jnp.zeros((b, k, slots, d)), "value": jnp.zeros((b, k, slots, d))}, *lengths),
    "quantized": LayerCache({"key": jnp.zeros(packed_shape, stored), "value": jnp.zeros(packed_shape, stored), **scales}, *lengths),
  }

  @jax.jit
  def prefill_and_step(cache):
    ctx, cache = cache.attend(q[:, :s], kk[:, :s], v[:, :s], 0, d**-0.5, None, jax.lax.Precision.HIGHEST, ())
    step = dataclasses.replace(cache, lengths=cache.lengths + s, new_lengths=jnp.ones((b,), jnp.int32))
    ctx2, _ = step.attend(q[:, s:], kk[:, s:], v[:, s:], 0, d**-0.5, None, jax.lax.Precision.HIGHEST, ())
    return jnp.concatenate([ctx, ctx2], axis=1)

  outs = {name: np.asarray(prefill_and_step(cache)) for name, cache in caches.items()}
  assert np.abs(outs["quantized"] - outs["float"]).max() < tolerance * np.abs(outs["float"]).max()
  config = from_overrides(**{**TINY, "num_devices": 1, "dtype": "bfloat16", "head_dim": 64})  # the quickstart's heads
  quantized = config.model_copy(update={"quantize_kvcache": True, "kv_quant_dtype": kv_dtype, "kv_quant_axis": axis})
  lay = cache_layout.layout(config)
  ratio = cache_layout.theoretical_bytes(quantized, 4, lay) / cache_layout.theoretical_bytes(config, 4, lay)
  assert ratio == cache_layout.nbytes(cache_layout.abstract(quantized, 4, lay))[0] / cache_layout.nbytes(cache_layout.abstract(config, 4, lay))[0]
  assert ratio <= (0.53 if kv_dtype == "int8" else 0.28)


def test_quantized_kv_values_are_within_half_a_step_of_their_stored_scale():
  """round(x / s) * s with s the stored (bfloat16) scale is within s / 2 of x: x is divided by the scale attention
  multiplies back, not by its float32 value before the cast (which would leave up to 127 x 2^-9 steps more)."""
  from maxtext.inference.kv_cache import quantize_kv

  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 16, 64)) * 5, jnp.bfloat16)
  q, s = quantize_kv(x, jnp.int8, per_head=True)
  assert s.dtype == jnp.bfloat16
  err = np.abs(np.asarray(q, np.float32) * np.asarray(s, np.float32) - np.asarray(x, np.float32))
  assert (err <= 0.5001 * np.asarray(s, np.float32)).all()


def test_mfu_peak_follows_the_matmul_format(monkeypatch):
  from maxtext.train import perf

  def peak(kind: str, mode: str) -> tuple[float, str]:
    monkeypatch.setattr(perf.platform, "device_kind", lambda: kind)
    return perf.peak_tflops(from_overrides(**{**TINY, "num_devices": 1, "quantization": mode}))

  assert peak("TPU v5 lite", "int8") == (394.0, "chip table, int8") and peak("TPU v5 lite", "")[0] == 197.0
  assert peak("NVIDIA H100 80GB HBM3", "fp8") == (1979.0, "chip table, fp8")
  assert peak("TPU v6 lite", "fp8") == (918.0, "chip table, bf16: TPU v6 lite has no fp8 units, XLA runs fp8 products in bf16")
  assert peak("TPU v5 lite", "int4w")[0] == 197.0  # weight-only: the products run in bf16


def test_int8_products_are_counted_in_compiled_hlo():
  """train_compile's count: the compiled module's matmuls with two s8 operands (TPUs write them as convolutions)."""
  from maxtext.aot.compile import count_int8_products

  r = quantization.Recipe("int8", "int8", "int8", None)
  x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 8), jnp.bfloat16)
  hlo = jax.jit(lambda x, w: quantization.einsum("ab,bc->ac", x, w, r, jnp.bfloat16)).lower(x, w).compile().as_text()
  assert count_int8_products(hlo) == 1
  tpu = """%fused (p0: s8[4,8], p1: s8[8,2]) -> bf16[4,2] {
  %param_0.13 = s8[4,8]{1,0:T(8,128)(4,1)} parameter(0)
  %param_1.11 = s8[8,2]{1,0} parameter(1)
  %convolution.3 = bf16[4,2]{1,0:T(8,128)(2,1)} convolution(%param_0.13, %param_1.11), dim_labels=bf_io->bf
  %other = bf16[4,2]{1,0} convolution(%a, %b), dim_labels=bf_io->bf
}"""
  assert count_int8_products(tpu) == 1


def test_int4_kernels_pack_two_values_per_byte():
  values = jnp.asarray(np.random.default_rng(0).integers(-8, 8, size=(3, 6, 4)), jnp.int8)
  packed = quantization.pack_int4(values, 1)
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 3, 4)
  np.testing.assert_array_equal(quantization.unpack_int4(packed, 1), values)
  r = quantization.Recipe("int4w", "int4", None, None, stored=True)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(256, 8)), jnp.float32)
  stored, scale = quantization.quantize_kernel(w, 1, r)
  assert stored.shape == (128, 8) and scale.shape == (2, 8)  # groups of 128 inputs
  x = jnp.ones((2, 256), jnp.float32)
  dequantized = np.asarray(quantization.unpack_int4(stored, 0), np.float32) * np.repeat(np.asarray(scale), 128, axis=0)
  np.testing.assert_allclose(quantization.stored_einsum("ab,bc->ac", x, stored, scale, r, jnp.float32), np.asarray(x) @ dequantized, rtol=1e-5)


@pytest.mark.parametrize("mode,calibration,grad_tolerance", [("int8", "absmax", 1e-5), ("fp8_full", "absmax,1.25", 0.15)])
def test_grouped_expert_product_scales_each_expert(mode, calibration, grad_tolerance):
  """The sorted dispatch's grouped matmul: weights quantized per expert and column by the recipe's calibration (one
  scale shared by all experts, as qwix's ragged_dot_qt has it, zeroes the small expert here), activations per row,
  as the dense dispatch's batched product does; int8 gradients straight-through (float ones), fp8's through e5m2,
  finite and near the float gradients and the dense path's."""
  rng = np.random.default_rng(0)
  group_sizes = jnp.array([5, 9, 6], jnp.int32)
  x = jnp.asarray(rng.normal(size=(20, 64)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 64, 32)) * np.array([0.01, 1.0, 30.0])[:, None, None], jnp.float32)
  fmt = quantization.FORMATS[mode]
  r = quantization.Recipe(mode, *fmt, weight_calibration=calibration, act_calibration=calibration, grad_calibration="absmax")
  rows = np.repeat(np.arange(3), np.asarray(group_sizes))
  c = jnp.asarray(rng.normal(size=(20, 32)), jnp.float32)

  def loss(x, w, product):
    return jnp.sum(c * product(x, w))

  def quantized(x, w):
    return quantization.ragged_dot(x, w, group_sizes, r, jnp.float32)

  def exact(x, w):  # the same quantization written out: per (expert, column) and per row, then float products
    qw = qwix.dequantize(qwix.quantize(w, quantization.qtype(fmt[0]), channelwise_axes=[0, 2], calibration_method=calibration))
    qx = qwix.dequantize(qwix.quantize(x, quantization.qtype(fmt[1]), channelwise_axes=[0], calibration_method=calibration))
    return jnp.einsum("mk,mkn->mn", qx, qw[rows], precision="highest")

  def dense(x, w):  # the dense dispatch's batched product (every expert over every row), each row's own expert taken
    return quantization.einsum("mk,ekn->men", x, w, r, jnp.float32)[np.arange(20), rows]

  def float_product(x, w):
    return jnp.einsum("mk,mkn->mn", x, w[rows], precision="highest")

  y, want, ref = quantized(x, w), exact(x, w), float_product(x, w)
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-6 * float(jnp.abs(want).max()))
  np.testing.assert_allclose(dense(x, w), y, rtol=1e-4, atol=1e-6 * float(jnp.abs(want).max()))
  for e in range(3):  # every expert within its format's error of its own float product
    assert float(jnp.abs(y - ref)[rows == e].max()) < 0.1 * float(jnp.abs(ref)[rows == e].max())
  grads, dense_grads, float_grads = (jax.grad(loss, (0, 1))(x, w, product) for product in (quantized, dense, float_product))
  for g, d, f in zip(grads, dense_grads, float_grads):
    scale = float(jnp.abs(f).max())
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g - f).max()) <= grad_tolerance * scale
    assert float(jnp.abs(g - d).max()) <= grad_tolerance * scale  # the sorted and dense paths' gradients agree


def test_stored_int8_experts_with_biases_agree_across_dispatch_paths():
  """gpt-oss on an int8 QLoRA base: expert kernels stored int8 with their scales, beside the float expert biases. The
  sorted dropless dispatch (qwix's ragged dot on the stored experts) and expert parallelism's all-to-all into capacity
  buffers (the dense dispatch's batched products, weights and scales split over `expert` and gathered over `fsdp`,
  ep4 x fsdp2) give the same loss, within int8's error of the float model's."""
  from maxtext import mesh as mesh_lib
  from maxtext.convert.model_params import model_from_flat, path_str
  from tests.test_moe_families import _batch as moe_batch
  from tests.test_moe_families import _jit_loss

  base = dict(GPT_OSS, capacity_factor=-1.0)
  float_config = from_overrides(**base)
  rng = np.random.default_rng(3)
  params = nnx.to_flat_state(nnx.state(models.abstract_model(float_config), nnx.Param))
  flat = {path_str(p): rng.normal(0.0, 0.3, v.shape).astype(np.float32) for p, v in params}  # nonzero biases, active clamps
  batch = moe_batch(b=8, s=8)
  ref = float(_jit_loss(model_from_flat(float_config, flat), float_config)(batch).xent)
  qlora = dict(base, quantization="int8", lora={"enable_lora": True, "lora_rank": 2})
  dropless = from_overrides(**qlora, megablox=False)
  model = model_from_flat(dropless, flat)  # the float kernels quantized on load
  experts = nnx.state(model, nnx.Param)["layers"]["mlp"]
  assert experts["wi_0"][...].dtype == jnp.int8 and experts["wi_0_scale"][...].dtype == jnp.float32 and experts["wo_bias"][...].dtype == jnp.float32
  losses = {"dropless": float(_jit_loss(model, dropless)(batch).xent)}
  ep = dict(capacity_factor=8.0, sparse_matmul=False, num_devices=8, ici_fsdp_parallelism=2, ici_expert_parallelism=4)  # room for every pair: nothing dropped
  config = from_overrides(**dict(qlora, **ep))
  mesh = mesh_lib.create(config)
  state = nnx.state(model)
  state = jax.device_put(state, models.state_shardings(state, config, mesh))
  graphdef = nnx.graphdef(models.abstract_model(config))
  with jax.set_mesh(mesh):
    losses["expert_parallel"] = float(jax.jit(lambda st, bt: loss_lib.loss_sums(nnx.merge(graphdef, st), bt, config))(state, batch).xent)
  np.testing.assert_allclose(losses["expert_parallel"], losses["dropless"], rtol=1e-4)
  assert losses["dropless"] != ref and abs(losses["dropless"] - ref) < 0.02 * abs(ref)
