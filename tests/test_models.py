"""Decoder behaviour: scan vs loop, remat policies, packing masks, sharded vs single-device, counts, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import mesh as mesh_lib
from maxtext import models
from maxtext.config import ConfigError, from_overrides
from maxtext.convert import hf_params
from maxtext.convert.model_params import flat_params, model_from_flat
from maxtext.counting import param_count

TINY = dict(
  base_emb_dim=32,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  base_mlp_dim=64,
  base_num_decoder_layers=2,
  head_dim=8,
  vocab_size=64,
  dtype="float32",
  matmul_precision="highest",
)
FAMILY_OVERRIDES = {
  "llama2": {},
  "mistral": dict(sliding_window_size=3),
  "mixtral": dict(num_experts=4, num_experts_per_tok=2),
  "qwen3": dict(use_qk_norm=True, logits_via_embedding=True),
  "gemma2": dict(sliding_window_size=3, attn_logits_soft_cap=50.0, final_logits_soft_cap=30.0, mlp_activations=["gelu", "linear"]),
  "qwen2": dict(attention_bias=True, logits_via_embedding=True),  # q/k/v biases only
  "olmo3": dict(use_qk_norm=True, sliding_window_size=3),  # post-norms only, whole-projection QK norm
}


def tiny(decoder_block="llama2", num_devices=1, **kw):
  return from_overrides(num_devices=num_devices, decoder_block=decoder_block, **{**TINY, **FAMILY_OVERRIDES[decoder_block], **kw})


def tokens(batch=2, seq=8, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(1, 64, size=(batch, seq)), jnp.int32)


def unstack(flat, layers):
  out = {}
  for k, v in flat.items():
    if k.startswith("layers/"):
      for i in range(layers):
        out[f"layers/{i}/{k[len('layers/') :]}"] = v[i]
    else:
      out[k] = v
  return out


@pytest.mark.parametrize("family", list(FAMILY_OVERRIDES))
def test_scan_and_loop_give_identical_outputs(family):
  scanned = models.build(tiny(family))
  looped = model_from_flat(tiny(family, scan_layers=False), unstack({k: np.asarray(v) for k, v in flat_params(scanned).items()}, 2))
  a, b = np.asarray(scanned(tokens())), np.asarray(looped(tokens()))
  np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(a).max())  # same maths; only float summation order differs


@pytest.mark.parametrize("family", list(FAMILY_OVERRIDES))
def test_param_count_matches_counting(family):
  config = tiny(family)
  actual = sum(np.size(v) for v in flat_params(models.build(config)).values())
  assert actual == param_count(config)


def test_remat_policies_agree_on_loss_and_grads():
  results = {}
  for policy in ("none", "full", "minimal", "save_dot_except_mlp", "save_out_proj"):
    config = tiny("llama2", remat_policy=policy)
    graphdef, params = nnx.split(models.build(config))

    def loss(p, graphdef=graphdef):
      return jnp.mean(nnx.merge(graphdef, p)(tokens()) ** 2)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    results[policy] = (float(value), jax.tree.leaves(grads))
  ref_value, ref_grads = results["none"]
  for policy, (value, grads) in results.items():
    assert value == pytest.approx(ref_value, rel=1e-6), policy
    for a, b in zip(grads, ref_grads, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=policy)


def test_gradients_together_returns_autodiff_gradients_through_one_barrier():
  """remat.gradients_together (the MTP layer's): the same gradients as plain autodiff, every cotangent leaving through
  one optimization_barrier in the backward pass (so XLA cannot postpone a weight gradient)."""
  from maxtext.models import remat

  def f(x, w, ids):
    return jnp.tanh(x @ w["a"]) @ w["b"] + ids[:, None].astype(x.dtype), ids

  rng = np.random.default_rng(0)
  x, w = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), {"a": jnp.asarray(rng.normal(size=(3, 5))), "b": jnp.asarray(rng.normal(size=(5, 2)))}
  ids = jnp.arange(4)

  def loss(fn):
    return lambda x, w: jnp.sum(fn(x, w, ids)[0] ** 2)

  tied = remat.gradients_together(f)
  want, got = jax.grad(loss(f), argnums=(0, 1))(x, w), jax.grad(loss(tied), argnums=(0, 1))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  assert str(jax.make_jaxpr(jax.grad(loss(tied), argnums=(0, 1)))(x, w)).count("optimization_barrier") == 1


def test_sequential_backward_returns_autodiff_gradients_one_layer_after_the_other():
  """remat.sequential_backward (each layer of a scanned group's): the same gradients as plain autodiff; in the backward
  pass each layer reads its saved input and weights only through a barrier that also holds its output's cotangent,
  and returns its three cotangents through one barrier, whose input cotangent is what the layer below waits for."""
  from maxtext.models import remat

  def f(x, w):
    return jnp.tanh(x @ w["a"]) @ w["b"]

  rng = np.random.default_rng(0)
  x, w = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), {"a": jnp.asarray(rng.normal(size=(3, 5))), "b": jnp.asarray(rng.normal(size=(5, 3)))}
  rematted = remat.wrap(f, "full", prevent_cse=False)
  ordered = remat.sequential_backward(rematted)

  def loss(fn):
    return lambda x, w: jnp.sum(jnp.sin(fn(fn(x, w), w)))

  want, got = jax.grad(loss(rematted), argnums=(0, 1))(x, w), jax.grad(loss(ordered), argnums=(0, 1))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  jaxpr = jax.make_jaxpr(jax.grad(loss(ordered), argnums=(0, 1)))(x, w).jaxpr
  upper_in, upper_out, lower_in, lower_out = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  assert [len(e.invars) for e in (upper_in, upper_out, lower_in, lower_out)] == [4, 3, 4, 3]  # (x, a, b, cotangent), (dx, da, db)
  assert lower_in.invars[-1] is upper_out.outvars[0]  # the lower layer starts from the upper one's finished input cotangent


def test_remat_full_saves_less_than_none():
  def temp_bytes(policy):
    config = tiny("llama2", remat_policy=policy, base_num_decoder_layers=4)
    graphdef, params = nnx.split(models.build(config))
    toks = tokens(4, 32)
    fn = jax.jit(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(toks) ** 2)))
    return fn.lower(params).compile().memory_analysis().temp_size_in_bytes

  assert temp_bytes("full") < temp_bytes("none")


@pytest.mark.parametrize("remat_policy", ["full", "minimal"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_offloaded_layer_inputs_move_to_host_and_change_nothing(remat_policy, scan_layers):
  """decoder_layer_input=offload: the saved layer inputs ([layers, B, S, E] when scanned) are host values in the
  gradient's jaxpr, absent with device; losses and gradients are bitwise those of device (XLA:CPU has one memory, so
  the TPU AOT test in test_splash_aot.py shows the HBM saved)."""
  import re

  toks = tokens()
  row = f"{toks.shape[0]},{toks.shape[1]},{TINY['base_emb_dim']}]"  # a layer input [B, S, E]
  stacked = f"f32<host>[{'2,' if scan_layers else ''}{row}"  # all of them, [layers, B, S, E] when scanned
  results = {}
  for where in ("device", "offload"):
    graphdef, params = nnx.split(models.build(tiny("llama2", remat_policy=remat_policy, scan_layers=scan_layers, decoder_layer_input=where)))
    grad_fn = jax.value_and_grad(lambda p, graphdef=graphdef: jnp.mean(nnx.merge(graphdef, p)(toks) ** 2))
    host = set(re.findall(r"\w+<host>\[[\d,]*\]", str(jax.make_jaxpr(grad_fn)(params))))
    value, grads = jax.jit(grad_fn)(params)
    results[where] = (host, np.asarray(value), [np.asarray(g) for g in jax.tree.leaves(grads)])
  host = results["offload"][0]
  assert results["device"][0] == set() and stacked in host and all(x.endswith(row) for x in host)
  np.testing.assert_array_equal(results["offload"][1], results["device"][1])
  for a, b in zip(results["offload"][2], results["device"][2], strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", ["llama2", "gemma2", "mixtral"])
def test_packed_row_equals_documents_run_alone(family):
  model = models.build(tiny(family))
  a, b = tokens(1, 5, seed=1), tokens(1, 7, seed=2)
  packed = jnp.concatenate([a, b], axis=1)
  positions = jnp.asarray([list(range(5)) + list(range(7))], jnp.int32)
  segments = jnp.asarray([[1] * 5 + [2] * 7], jnp.int32)
  out = np.asarray(model(packed, positions, segments))
  np.testing.assert_allclose(out[:, :5], np.asarray(model(a)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[:, 5:], np.asarray(model(b)), rtol=1e-5, atol=1e-5)


MESHES = [
  dict(ici_fsdp_parallelism=8),
  dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2),
  dict(ici_data_parallelism=2, ici_fsdp_parallelism=4),
  dict(ici_fsdp_parallelism=4, ici_sequence_parallelism=2),
  dict(ici_fsdp_parallelism=4, ici_expert_parallelism=2),
]


@pytest.fixture(scope="module")
def single_device_reference():
  out = {}
  for family in ("llama2", "mixtral"):
    config = tiny(family, base_num_kv_heads=4, base_emb_dim=64)
    model = models.build(config)
    out[family] = ({k: np.asarray(v) for k, v in flat_params(model).items()}, np.asarray(model(tokens(8, 16))))
  return out


@pytest.mark.parametrize("mesh_kw", MESHES, ids=["fsdp8", "fsdp4-tp2", "dp2-fsdp4", "fsdp4-sp2", "fsdp4-ep2"])
@pytest.mark.parametrize("family", ["llama2", "mixtral"])
def test_sharded_logits_equal_single_device(single_device_reference, family, mesh_kw):
  flat, ref = single_device_reference[family]
  config = tiny(family, num_devices=8, base_num_kv_heads=4, base_emb_dim=64, **mesh_kw)
  mesh = mesh_lib.create(config)
  model = model_from_flat(config, flat, mesh)
  graphdef, state = nnx.split(model)
  batch = jax.device_put(tokens(8, 16), mesh_lib.data_sharding(config, mesh))
  with jax.set_mesh(mesh):
    out = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, batch)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_create_sharded_params_are_born_sharded_and_match_build():
  config = tiny("llama2", num_devices=8, base_emb_dim=64, ici_fsdp_parallelism=4, ici_tensor_parallelism=2)
  mesh = mesh_lib.create(config)
  model = models.create_sharded(config, mesh)
  shardings = models.sharding_tree(model)
  assert shardings["embed/embedding"].spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert shardings["layers/mlp/wi_0/kernel"].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert shardings["layers/attention/query/kernel"].spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  reference = flat_params(models.build(tiny("llama2", base_emb_dim=64)))
  for k, v in flat_params(model).items():  # one jitted init against op-by-op ones: the tests' fast-compile flags (tests/xla_env.py) may differ in the last bit
    np.testing.assert_allclose(np.asarray(v), np.asarray(reference[k]), rtol=1e-6, atol=0, err_msg=k)


def test_bfloat16_forward_is_close_to_float32():
  f32 = models.build(tiny("llama2"))
  bf16 = model_from_flat(tiny("llama2", dtype="bfloat16", matmul_precision="default"), {k: np.asarray(v) for k, v in flat_params(f32).items()})
  a, b = np.asarray(f32(tokens())), np.asarray(bf16(tokens()))
  assert b.dtype == np.float32 and np.isfinite(b).all()
  assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


def test_converter_rejects_unused_and_missing_tensors():
  config = tiny("llama2")
  hf = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(models.build(config)).items()}, config)
  with pytest.raises(ConfigError, match=r"1 tensor\(s\) the llama2 model does not use: model.layers.0.extra.weight"):
    hf_params.hf_to_maxtext({**hf, "model.layers.0.extra.weight": np.zeros(3)}, config)
  hf.pop("model.layers.1.mlp.up_proj.weight")
  with pytest.raises(ConfigError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
    hf_params.hf_to_maxtext(hf, config)


def test_model_from_flat_reports_shape_mismatch():
  config = tiny("llama2")
  flat = {k: np.asarray(v) for k, v in flat_params(models.build(config)).items()}
  flat["final_norm/scale"] = np.ones(7, np.float32)
  with pytest.raises(ConfigError, match=r"'final_norm/scale' has shape \(7,\)"):
    model_from_flat(config, flat)


def test_indivisible_parameter_sharding_is_a_config_error():
  config = tiny("llama2", num_devices=8, base_num_query_heads=8, base_num_kv_heads=4, ici_tensor_parallelism=8, ici_fsdp_parallelism=1)
  mesh = mesh_lib.create(config)
  with pytest.raises(ConfigError, match=r"layers/attention/key/kernel dimension 2 \(logical 'kv_heads', size 4\) cannot be split 8 ways"):
    models.create_sharded(config, mesh)
