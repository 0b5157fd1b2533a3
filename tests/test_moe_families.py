"""DeepSeek V3 and Qwen3-MoE beyond logits parity: parameter counts, routing, capacity, balancing, MTP, conversion."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import counting, models, platform
from maxtext.config import from_overrides
from maxtext.convert import hf_params
from maxtext.convert.model_params import flat_params, model_from_flat
from maxtext.errors import ConfigError
from maxtext.layers import moe
from maxtext.models import feed_forward_specs
from maxtext.train import loss as loss_lib

BASE = dict(num_devices=1, vocab_size=64, base_emb_dim=16, base_num_query_heads=2, base_num_kv_heads=2, head_dim=8, base_mlp_dim=24)
DEEPSEEK = dict(
  BASE,
  decoder_block="deepseek",
  base_num_decoder_layers=3,
  base_moe_mlp_dim=8,
  num_experts=8,
  num_experts_per_tok=2,
  shared_experts=1,
  first_num_dense_layers=1,
  routed_score_func="sigmoid",
  routed_bias=True,
  routed_scaling_factor=2.5,
  n_routing_groups=4,
  topk_routing_group=2,
  norm_topk_prob=True,
  q_lora_rank=8,
  kv_lora_rank=8,
  qk_nope_head_dim=4,
  qk_rope_head_dim=4,
  v_head_dim=6,
  rope_type="yarn",
  rope_factor=4,
  original_max_position_embeddings=4,
  mtp_num_layers=1,
  dtype="float32",
)
QWEN3_MOE = dict(BASE, decoder_block="qwen3_moe", base_num_decoder_layers=2, base_moe_mlp_dim=8, num_experts=4, num_experts_per_tok=2, use_qk_norm=True)
GPT_OSS = dict(
  BASE,
  decoder_block="gpt_oss",
  base_num_decoder_layers=2,
  base_moe_mlp_dim=8,
  num_experts=8,
  num_experts_per_tok=2,
  sliding_window_size=4,
  attention_bias=True,
  attention_sink=True,
  routed_bias=True,
  mlp_bias=True,
  norm_topk_prob=True,
  mlp_activations=["sigmoid", "linear"],
  mlp_activations_limit=0.5,
  rope_type="yarn",
  rope_factor=4,
  original_max_position_embeddings=4,
  rope_interleave=False,
  dtype="float32",
)
GEMMA3 = dict(BASE, decoder_block="gemma3", base_num_decoder_layers=7, sliding_window_size=4, use_qk_norm=True, local_rope_max_timescale=10_000.0)


def _build(config) -> models.Transformer:
  """models.build, with the initialisation compiled (eager init of many small arrays is slow on CPU)."""
  graphdef = nnx.graphdef(models.abstract_model(config))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.state(models.build(config, nnx.Rngs(0))))())


def _jit_loss(model, config, training=True):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda st, batch: loss_lib.loss_sums(nnx.merge(graphdef, st), batch, config, training))
  return lambda batch: fn(state, batch)


def _batch(b: int = 2, s: int = 8, seed: int = 0) -> dict[str, jax.Array]:
  tokens = np.random.default_rng(seed).integers(1, 64, size=(b, s + 1)).astype(np.int32)
  ones = np.ones((b, s), np.int32)
  pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "inputs_position": pos,
    "inputs_segmentation": ones,
    "targets_segmentation": ones,
  }


@pytest.mark.parametrize(
  "overrides",
  [DEEPSEEK, dict(DEEPSEEK, q_lora_rank=0, scan_layers=False), QWEN3_MOE, GPT_OSS, GEMMA3],
  ids=["deepseek", "deepseek_q0", "qwen3_moe", "gpt_oss", "gemma3"],
)
def test_param_count_equals_the_built_model(overrides):
  config = from_overrides(**overrides)
  state = nnx.state(models.abstract_model(config))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == counting.param_count(config)


def _reference_route(logits, bias, groups, topk_groups, k, scale):
  """Numpy DeepSeek V3 routing (HF DeepseekV3TopkRouter), token by token."""
  scores = 1 / (1 + np.exp(-logits))
  weights, experts = [], []
  for s in scores:
    choice = s + bias
    per_group = choice.reshape(groups, -1)
    group_score = np.sort(per_group, axis=-1)[:, -2:].sum(-1)
    allowed = np.argsort(-group_score, kind="stable")[:topk_groups]
    masked = np.full_like(choice, -np.inf).reshape(groups, -1)
    masked[allowed] = per_group[allowed]
    chosen = np.argsort(-masked.reshape(-1), kind="stable")[:k]
    w = s[chosen] / s[chosen].sum()
    weights.append(w * scale)
    experts.append(chosen)
  return np.array(weights), np.array(experts)


def test_group_limited_sigmoid_routing_matches_its_definition():
  config = from_overrides(**DEEPSEEK)
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(64, 8)).astype(np.float32)
  bias = (0.3 * rng.normal(size=(8,))).astype(np.float32)
  r = moe.route(jnp.asarray(logits), feed_forward_specs.moe(config).routing, jnp.asarray(bias))
  ref_w, ref_e = _reference_route(logits, bias, 4, 2, 2, 2.5)
  order = np.argsort(np.asarray(r.experts), axis=-1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(r.experts), order, -1), np.sort(ref_e, -1))
  ref_w_sorted = np.take_along_axis(ref_w, np.argsort(ref_e, -1), -1)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(r.weights), order, -1), ref_w_sorted, rtol=1e-5)
  # Every token's experts lie in at most topk_routing_group groups.
  assert max(len(set(e // 2)) for e in np.asarray(r.experts)) <= 2


def test_routing_bias_moves_choice_but_not_weights():
  config = from_overrides(**dict(DEEPSEEK, n_routing_groups=-1, topk_routing_group=-1, norm_topk_prob=False, routed_scaling_factor=1.0))
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(16, 8)), jnp.float32)
  bias = jnp.zeros((8,)).at[7].set(10.0)  # expert 7 always chosen, weighted by its own unbiased score
  r = moe.route(logits, feed_forward_specs.moe(config).routing, bias)
  assert np.all(np.any(np.asarray(r.experts) == 7, axis=-1))
  picked = np.asarray(r.weights)[np.asarray(r.experts) == 7]
  np.testing.assert_allclose(picked, np.asarray(jax.nn.sigmoid(logits[:, 7])), rtol=1e-6)


def test_load_balance_loss_matches_its_definition():
  rng = np.random.default_rng(3)
  probs = rng.dirichlet(np.ones(4), size=6).astype(np.float32)
  experts = np.array([[0, 1], [0, 2], [0, 1], [3, 0], [1, 2], [0, 3]])
  valid = np.array([1, 1, 1, 1, 0, 1], bool)
  frac = np.array([sum((experts[t] == e).sum() for t in range(6) if valid[t]) for e in range(4)]) / (5 * 2)
  mean_prob = probs[valid].mean(axis=0)
  expected = 4 * np.sum(frac * mean_prob)
  np.testing.assert_allclose(moe.load_balance_loss(jnp.asarray(probs), jnp.asarray(experts), jnp.asarray(valid)), expected, rtol=1e-6)
  uniform = np.full((4, 4), 0.25, np.float32)
  balanced = np.array([[0, 1], [2, 3], [0, 1], [2, 3]])
  assert float(moe.load_balance_loss(jnp.asarray(uniform), jnp.asarray(balanced), jnp.ones(4, bool))) == pytest.approx(1.0)


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts():
  bias = jnp.zeros((2, 4))
  load = jnp.asarray([[10.0, 2.0, 4.0, 4.0], [5.0, 5.0, 5.0, 5.0]])
  new = np.asarray(moe.bias_update(bias, load, 0.01))
  np.testing.assert_allclose(new, [[-0.01, 0.01, 0.01, 0.01], [0.0, 0.0, 0.0, 0.0]])


def test_capacity_drops_late_tokens_and_counts_them():
  experts = jnp.asarray([[0, 1], [0, 2], [0, 1], [0, 3]])
  np.testing.assert_array_equal(moe.capacity_positions(experts, 4), [[0, 0], [1, 0], [2, 1], [3, 0]])
  np.testing.assert_array_equal(moe.capacity_positions(jnp.stack([experts, experts[::-1]]), 4)[1], [[0, 0], [1, 0], [2, 0], [3, 1]])
  config = from_overrides(**dict(QWEN3_MOE, capacity_factor=1.0, dtype="float32"))  # per sequence: 8 tokens x 2 / 4 experts -> 4
  assert moe.expert_capacity(8, feed_forward_specs.moe(config)) == 4
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 8, 16)), jnp.float32)
  valid = jnp.ones((2, 8), bool)

  @functools.partial(jax.jit, static_argnums=0)
  def run(cf: float):
    cfg = from_overrides(**dict(QWEN3_MOE, capacity_factor=cf, dtype="float32"))
    layer = moe.MoE(feed_forward_specs.moe(cfg), policy=platform.for_platform(cfg, "cpu"), rngs=nnx.Rngs(0))
    return layer(x, valid), moe.route(layer.gate(x.reshape(16, 16)), layer.spec.routing).experts

  (y, stats), experts = run(1.0)
  per_row = np.stack([np.bincount(row.reshape(-1), minlength=4) for row in np.asarray(experts).reshape(2, 16)])
  assert float(stats["dropped"]) == np.maximum(per_row - 4, 0).sum() > 0
  np.testing.assert_array_equal(stats["load"], per_row.sum(0))
  (y_roomy, s_roomy), _ = run(4.0)
  (y_dropless, _), _ = run(-1.0)
  np.testing.assert_allclose(y_roomy, y_dropless, atol=1e-5)
  assert float(s_roomy["dropped"]) == 0
  assert not np.allclose(y, y_roomy, atol=1e-5)


@pytest.fixture(scope="module")
def deepseek_model():
  config = from_overrides(**DEEPSEEK)
  return config, _build(config)


def test_mtp_is_a_training_only_loss_over_visible_targets(deepseek_model):
  config, model = deepseek_model
  batch = _batch()
  train_fn = _jit_loss(model, config)
  train = train_fn(batch)
  evaluation = _jit_loss(model, config, training=False)(batch)
  assert float(train.mtp) > 0 and float(evaluation.mtp) == 0
  np.testing.assert_allclose(train.xent, evaluation.xent, rtol=1e-6)
  # One-token documents: the MTP module (a target one position further) has nothing inside a document to predict.
  short = dict(batch, inputs_segmentation=np.tile(np.arange(1, 9, dtype=np.int32), (2, 1)))
  short["targets_segmentation"] = short["inputs_segmentation"]
  assert float(train_fn(short).mtp) == 0 and float(train_fn(short).xent) > 0


def test_deepseek_round_trips_through_hf_names_with_mtp_and_experts(deepseek_model):
  config, model = deepseek_model
  ours = {k: np.asarray(v) for k, v in flat_params(model).items()}
  hf = hf_params.maxtext_to_hf(ours, config)
  assert "model.layers.3.eh_proj.weight" in hf and "model.layers.3.mlp.experts.7.down_proj.weight" in hf
  assert "model.layers.0.mlp.gate_proj.weight" in hf and "model.layers.1.mlp.gate.e_score_correction_bias" in hf
  back = hf_params.hf_to_maxtext(hf, config)
  assert sorted(back) == sorted(ours)
  for k, v in ours.items():
    assert np.array_equal(back[k], v), k
  no_mtp = config.model_copy(update={"mtp_num_layers": 0})
  assert not any(k.startswith("mtp/") for k in hf_params.hf_to_maxtext(hf, no_mtp, stored_mtp_layers=config.mtp_num_layers))
  with pytest.raises(ConfigError, match="num_hidden_layers is 3: the layers past it would be dropped"):  # only declared MTP layers may be left out
    hf_params.hf_to_maxtext(hf, no_mtp)
  assert isinstance(model_from_flat(config, back), models.Transformer)


def test_gpt_oss_biased_experts_agree_across_dispatch_paths():
  """Expert and router biases reach every dispatch path: dropless (grouped matmuls), capacity buffers, and the all-to-all
  of expert parallelism (ep4 x fsdp2 on 8 devices) give the same loss, with nonzero biases and the clamps active."""
  from maxtext import mesh as mesh_lib

  base = dict(GPT_OSS, capacity_factor=-1.0)
  dropless = from_overrides(**base)
  rng = np.random.default_rng(3)
  flat = {k: (np.asarray(v) + rng.normal(0.0, 0.3, np.shape(v))).astype(np.float32) for k, v in flat_params(_build(dropless)).items()}
  assert any(k.endswith("mlp/wi_0_bias") for k in flat) and any(k.endswith("mlp/gate/bias") for k in flat)
  batch = _batch(b=8, s=8)
  ref = _jit_loss(model_from_flat(dropless, flat), dropless)(batch)
  capacity = from_overrides(**dict(base, capacity_factor=8.0))  # room for every pair: nothing dropped
  np.testing.assert_allclose(_jit_loss(model_from_flat(capacity, flat), capacity)(batch).xent, ref.xent, rtol=1e-5)
  config = from_overrides(**dict(base, capacity_factor=8.0, num_devices=8, ici_fsdp_parallelism=2, ici_expert_parallelism=4))
  mesh = mesh_lib.create(config)
  graphdef, state = nnx.split(model_from_flat(config, flat, mesh))
  with jax.set_mesh(mesh):
    out = jax.jit(lambda st, bt: loss_lib.loss_sums(nnx.merge(graphdef, st), bt, config))(state, batch)
  np.testing.assert_allclose(out.xent, ref.xent, rtol=1e-5)


MLA_AND_SHARED = r".*(attention/(wq_a|wq_b|wq|wkv_a|wkv_b|out)|mlp/shared_experts/(wi_0|wi_1|wo)|mlp/gate)$"


def test_lora_on_qwen3_moe_reaches_attention_and_router():
  config = from_overrides(**dict(QWEN3_MOE, lora={"enable_lora": True, "lora_rank": 2}))
  names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(models.abstract_model(config)))}
  assert {"layers/attention/query/lora/lora_a", "layers/attention/out/lora/lora_b"} <= names
  assert not any("mlp/wi_0/lora" in n for n in names)  # routed experts take no adapters
  assert counting.param_count(config) == sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(models.abstract_model(config))))


@pytest.mark.parametrize("family", ["deepseek"])
def test_lora_is_identity_at_init(family):
  """Adapters on MLA's projections, the router and the shared experts leave the logits unchanged at init.

  (mHC identity on both families is tests/test_mhc.py's test_identity_at_init_on_hf_weights.)
  """
  base = dict(DEEPSEEK, mtp_num_layers=0) if family == "deepseek" else dict(QWEN3_MOE, dtype="float32")
  path = MLA_AND_SHARED if family == "deepseek" else r".*(attention/(query|key|value|out)|mlp/gate)$"
  plain = from_overrides(**base)
  flat = {k: np.asarray(v) for k, v in flat_params(_build(plain)).items()}
  adapted = from_overrides(**dict(base, lora={"enable_lora": True, "lora_rank": 2, "lora_module_path": path}))
  model = model_from_flat(adapted, flat)
  names = set(flat_params(model))
  if family == "deepseek":
    for module in ("attention/wq_a", "attention/wkv_b", "mlp/shared_experts/wi_0", "mlp/gate"):
      assert f"layers/{module}/lora/lora_a" in names, module
  assert counting.param_count(adapted) == sum(int(np.prod(v.shape)) for v in flat_params(model).values())
  tokens = jnp.asarray(_batch()["inputs"])
  graphdef, state = nnx.split(model)
  ref_graphdef, ref_state = nnx.split(model_from_flat(plain, flat))
  out = jax.jit(lambda st: nnx.merge(graphdef, st)(tokens))(state)
  ref = jax.jit(lambda st: nnx.merge(ref_graphdef, st)(tokens))(ref_state)
  np.testing.assert_allclose(out, ref, atol=1e-5)


def test_lora_on_routed_experts_is_a_config_error():
  from maxtext.errors import ConfigError

  config = from_overrides(**dict(QWEN3_MOE, lora={"enable_lora": True, "lora_module_path": "mlp/wi_0$"}))
  with pytest.raises(ConfigError, match="routed expert"):
    models.abstract_model(config)
