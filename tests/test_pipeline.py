"""Pipeline parallelism on 8 simulated CPU devices (float32): losses, gradients, training and checkpoints equal the
unpipelined model's.

Each model's parameters are initialised and perturbed once, on the host, and placed into every layout; its unpipelined
reference is computed once and serves its cases (tests/test_context_parallel.py's too). The llama-like model's pipeline
case is its training run (test_ten_training_steps_...): the first step's loss and gradient norm, and the parameters
after 10 steps. The tests' own programs compile with XLA's backend optimisations off (FAST_COMPILE): the same HLO,
compiled in about two thirds of the time.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from maxtext import mesh as mesh_lib
from maxtext import models
from maxtext.config import from_overrides
from maxtext.models import pipeline, pipeline_specs
from maxtext.train import loss as loss_lib
from tests.test_train_helpers import FAST_COMPILE

SMALL = dict(
  base_emb_dim=32,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  head_dim=8,
  base_mlp_dim=64,
  base_num_decoder_layers=8,
  vocab_size=128,
  max_target_length=16,
  per_device_batch_size=2,
  dataset_type="synthetic",
  dtype="float32",
  matmul_precision="highest",
)
MODELS = {
  "llama": dict(remat_policy="full", max_target_length=32),  # GQA (4 query, 2 key/value heads)
  "mixtral": dict(
    decoder_block="mixtral",
    num_experts=4,
    num_experts_per_tok=2,
    load_balance_loss_weight=0.1,
    sliding_window_size=8,
    attn_logits_soft_cap=20.0,
    max_target_length=32,
    remat_policy="minimal",
  ),
  "deepseek_v32": dict(  # DeepSeek Sparse Attention (top 6 of 32 keys) over MLA, a dense first layer, then MoE
    model_name="deepseek3-tiny",
    override_model_config=True,
    decoder_block="deepseek_v32",
    use_indexer=True,
    indexer_n_heads=2,
    indexer_head_dim=8,
    indexer_topk=6,
    indexer_sparse_training=True,
    indexer_loss_scaling_factor=0.5,
    base_num_decoder_layers=2,
    first_num_dense_layers=1,
    base_moe_mlp_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    n_routing_groups=-1,
    topk_routing_group=-1,
    routed_bias=False,
    routed_bias_update_rate=0.0,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    mtp_num_layers=0,
    max_target_length=32,
  ),
  "gemma2_mhc_lora": {
    "decoder_block": "gemma2",
    "sliding_window_size": 4,
    "attn_logits_soft_cap": 50.0,
    "final_logits_soft_cap": 30.0,
    "mhc_expansion_rate": 4,
    "lora.enable_lora": True,
    "lora.lora_rank": 4,
    "remat_policy": "none",
  },
}
# (model, pipeline and mesh keys): 2 and 4 stages, 1 and 2 repeats, 4 and 8 microbatches, with fsdp, tensor and expert
# axes (the llama-like model's training run, PIPELINED below, adds 2 stages x 2 repeats x 4 microbatches with fsdp,
# tensor and pipeline_fsdp_ag_once).
CASES = [
  (  # with context parallelism too: tests/test_context_parallel.py's 2 shards, ring, natural order, sliding window
    "mixtral",
    dict(
      ici_pipeline_parallelism=2,
      ici_expert_parallelism=2,
      ici_context_parallelism=2,
      ici_fsdp_parallelism=1,
      context_parallel_strategy="ring",
      context_parallel_load_balance=False,
      num_layers_per_pipeline_stage=4,
      num_pipeline_microbatches=4,
    ),
  ),
  (
    "gemma2_mhc_lora",
    dict(
      ici_pipeline_parallelism=4,
      ici_tensor_parallelism=2,
      num_layers_per_pipeline_stage=1,
      num_pipeline_microbatches=8,
      pipeline_delay_activation_forwarding=True,
    ),
  ),
]


def config_for(model: str, **keys):
  return from_overrides(num_devices=8, **{**SMALL, **MODELS[model], **keys})


def packed_batch(config, seed: int = 0) -> dict[str, np.ndarray]:
  """Random tokens; every other row packs two documents (segment ids 1, 2; positions restart)."""
  rng = np.random.default_rng(seed)
  b, s = config.global_batch_size_to_train_on, config.max_target_length
  tokens = rng.integers(1, config.vocab_size, (b, s + 1)).astype(np.int32)
  segments = np.ones((b, s), np.int32)
  segments[::2, s // 2 :] = 2
  positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()
  positions[::2, s // 2 :] -= s // 2
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], inputs_segmentation=segments, targets_segmentation=segments)
  batch.update(inputs_position=positions, targets_position=positions)
  if config.lora.max_lora_adapters > 1:
    batch["adapter_ids"] = (np.arange(b) % config.lora.max_lora_adapters).astype(np.int32)
  return batch


@functools.cache
def initial_params(model: str) -> dict[str, np.ndarray]:
  """The model's parameters in plain layer order, by path, perturbed from their init (so that every gradient, mHC
  connectors' and LoRA's included, is far from zero); made once per model, laid out for each config by `placed`."""
  state = jax.jit(lambda: nnx.state(models.build(config_for(model)), nnx.Param), compiler_options=FAST_COMPILE)()  # cheaper than eager
  rng = np.random.default_rng(0)
  return {"/".join(map(str, k)): np.asarray(v.get_value()) + 0.05 * rng.standard_normal(v.shape).astype(np.float32) for k, v in nnx.to_flat_state(state)}


def placed(model: str, config, mesh) -> tuple[nnx.GraphDef, nnx.State]:
  """initial_params(model) in this config's train-state layout (pipeline.from_storage on the host), sharded over mesh."""
  graphdef, abstract, rest = nnx.split(models.abstract_model(config), nnx.Param, ...)
  assert not jax.tree.leaves(rest)
  shardings = models.state_shardings(abstract, config, mesh)
  values = initial_params(model)
  stored = [
    (path, var.replace(value=values["/".join(map(str, path))]))
    for path, var in nnx.to_flat_state(pipeline.to_storage(abstract, pipeline_specs.pipeline(config)))
  ]
  host = dict(nnx.to_flat_state(pipeline.from_storage(nnx.from_flat_state(stored), pipeline_specs.pipeline(config))))
  flat = [
    (path, var.replace(value=jax.device_put(host[path].get_value(), sharding)))
    for (path, var), (_, sharding) in zip(nnx.to_flat_state(abstract), nnx.to_flat_state(shardings), strict=True)
  ]
  return graphdef, nnx.from_flat_state(flat)


def loss_and_grads(model: str, config) -> tuple[float, dict[str, np.ndarray]]:
  """Loss and gradients (plain layer order, by path) of the model's initial_params on packed_batch."""
  mesh = mesh_lib.create(config, jax.devices()[: config.num_devices])
  with jax.set_mesh(mesh):
    graphdef, params = placed(model, config, mesh)
    batch = packed_batch(config)

    def objective(params):
      sums = loss_lib.loss_sums(nnx.merge(graphdef, params), batch, config)
      return (sums.xent + sums.z_loss + sums.indexer) / sums.weights + sums.aux  # indexer: DeepSeek Sparse Attention's KL

    loss, grads = jax.jit(jax.value_and_grad(objective), compiler_options=FAST_COMPILE)(params)
  grads = pipeline.to_storage(grads, pipeline_specs.pipeline(config))
  return float(loss), {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}


@functools.cache
def reference(model: str) -> tuple[float, dict[str, np.ndarray]]:
  return loss_and_grads(model, config_for(model))


def case_id(model: str, keys: dict) -> str:
  context = keys.get("ici_context_parallelism", 1)
  return f"{model}-{keys['ici_pipeline_parallelism']}stages-{keys['num_pipeline_microbatches']}mb" + (f"-{context}context" if context > 1 else "")


@pytest.mark.parametrize("model,keys", CASES, ids=[case_id(*c) for c in CASES])
def test_pipelined_loss_and_gradients_equal_unpipelined(model, keys):
  config = config_for(model, **keys)
  plan = pipeline_specs.pipeline_plan(config)
  assert plan.stages == keys["ici_pipeline_parallelism"] and plan.microbatches == keys["num_pipeline_microbatches"]
  ref_loss, ref_grads = reference(model)
  loss, grads = loss_and_grads(model, config)
  assert loss == pytest.approx(ref_loss, rel=1e-5)
  assert grads.keys() == ref_grads.keys()
  assert_gradients_close(grads, ref_grads)


def assert_gradients_close(grads: dict[str, np.ndarray], ref: dict[str, np.ndarray], rel: float = 1e-5) -> None:
  """Every parameter's gradient within rel of its norm, or of 1% of the largest parameter gradient's norm where that
  is larger: float32 reduction order alone moves mHC's tiny residual-mixing gradients by ~1e-3 of themselves
  (measured between two unpipelined meshes), far below the other gradients. The whole gradient within rel too."""
  norms = {name: np.linalg.norm(g) for name, g in ref.items()}
  floor = 0.01 * max(norms.values())
  for name, g in ref.items():
    assert norms[name] > 0, name
    assert np.linalg.norm(grads[name] - g) <= rel * max(norms[name], floor), name
  total = np.sqrt(sum(np.sum((grads[k] - g) ** 2) for k, g in ref.items()))
  assert total <= rel * np.sqrt(sum(n**2 for n in norms.values()))


TRAIN = dict(learning_rate=1e-3, warmup_steps_fraction=0.0, enable_tensorboard=False, async_checkpointing=False, run_name="r")
PIPELINED = dict(
  ici_pipeline_parallelism=2,
  ici_fsdp_parallelism=2,
  ici_tensor_parallelism=2,
  num_layers_per_pipeline_stage=2,
  num_pipeline_microbatches=4,
  pipeline_fsdp_ag_once=True,
)
# pipeline_parallel_layers: the first 4 of the 8 layers pipelined (2 stages x 2 repeats), the other 4 after the pipeline
# on every stage.
PARTIAL = dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2, pipeline_parallel_layers=4, num_pipeline_microbatches=4)
CIRCULAR_4 = dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_layers_per_pipeline_stage=1, num_pipeline_microbatches=8)


def train_config(tmp_path_factory, name: str, **keys):
  return config_for("llama", base_output_directory=str(tmp_path_factory.mktemp(name)), **TRAIN, **keys)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(config, setup, first step's metrics, state after 10 steps) without and with a circular 2-stage pipeline (of all
  layers, and of the first half with pipeline_parallel_layers), from the same initial state (the plain one, put in the pipeline's layer order and shardings) and batches."""
  from maxtext.train import setup as setup_lib

  runs, initial = {}, None
  for name, keys in (("plain", {}), ("pipelined", PIPELINED), ("partial", PARTIAL)):
    config = train_config(tmp_path_factory, name, **keys)
    mesh = mesh_lib.create(config, jax.devices()[: config.num_devices])
    with jax.set_mesh(mesh):
      setup = setup_lib.build(config, mesh)
      if initial is None:
        state = jax.jit(setup.init_fn, out_shardings=setup.state_shardings, compiler_options=FAST_COMPILE)()  # setup.init_state()
        initial = jax.tree.map(np.asarray, state)  # a host copy: the plain run donates its state
      else:
        state = jax.device_put(pipeline.from_storage(initial, pipeline_specs.pipeline(config)), setup.state_shardings)
      batches = [packed_batch(config, seed=step) for step in range(10)]
      train_step, metrics = setup.jit_step.lower(state, batches[0]).compile(FAST_COMPILE), []
      for batch in batches:
        state, m = train_step(state, batch)
        metrics.append(m)
    runs[name] = (config, setup, jax.device_get(metrics[0]), jax.block_until_ready(state))
  return runs


def plain_params(state, config) -> dict[str, np.ndarray]:
  return {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(pipeline.to_storage(state["params"], pipeline_specs.pipeline(config)))}


def test_ten_training_steps_give_the_unpipelined_parameters(trained):
  (config, _, first, state), (pp_config, _, pp_first, pp_state) = trained["plain"], trained["pipelined"]
  assert pipeline_specs.pipeline_plan(pp_config).repeats == 2
  for key in ("loss", "grad_norm"):
    assert float(pp_first[key]) == pytest.approx(float(first[key]), rel=1e-5), key
  ref, got = plain_params(state, config), plain_params(pp_state, pp_config)
  for name, value in ref.items():  # Adam's normalised steps turn float32 noise in near-zero gradients into single-element
    assert np.linalg.norm(got[name] - value) <= 1e-5 * np.linalg.norm(value), name  # differences: compare whole parameters
  assert (
    "pipeline: 8 of 8 layers pipelined, circular (2 repeats of 2 layers per stage), 2 stages, 4 microbatches, 9 iterations, bubble 11.1%"
    in pipeline.banner(pipeline_specs.pipeline_plan(pp_config))
  )


def test_checkpoint_round_trip_across_pipeline_degrees_is_bitwise(trained, tmp_path_factory):
  """Saved without a pipeline, restored under 4 stages (circular), saved again and restored without: the same bits;
  the checkpoint on disk holds the plain layer order both times."""
  from maxtext.train import setup as setup_lib
  from maxtext.train.checkpointing import Checkpointer

  config, setup, _, state = trained["plain"]
  Checkpointer(config).save(10, state, None)
  pp_config = train_config(tmp_path_factory, "circular", **CIRCULAR_4).model_copy(update={"checkpoint_dir": config.checkpoint_dir})
  pp_setup = setup_lib.build(pp_config, mesh_lib.create(pp_config, jax.devices()[: pp_config.num_devices]))
  pp_ckpt = Checkpointer(pp_config)
  with jax.set_mesh(pp_setup.mesh):
    restored = pp_ckpt.restore_latest(pp_setup.abstract_state).state
  order = pipeline_specs.pipeline_plan(pp_config).order()
  assert pipeline_specs.pipeline_plan(pp_config).repeats == 2 and pipeline_specs.pipeline_plan(pp_config).stages == 4
  kernel = np.asarray(dict(nnx.to_flat_state(restored["params"]))[("layers", "mlp", "wo", "kernel")].get_value())
  np.testing.assert_array_equal(kernel, np.asarray(state["params"]["layers"]["mlp"]["wo"]["kernel"].get_value())[order])
  pp_ckpt.directory = pp_ckpt.directory.parent / "again"
  pp_ckpt.manager = Checkpointer(pp_config.model_copy(update={"checkpoint_dir": str(pp_ckpt.directory)})).manager
  pp_ckpt.save(10, restored, None)
  back = Checkpointer(config.model_copy(update={"checkpoint_dir": str(pp_ckpt.directory)}))
  with jax.set_mesh(setup.mesh):
    again = back.restore_latest(setup.abstract_state).state
  for (path, a), (_, b) in zip(nnx.to_flat_state(state["params"]), nnx.to_flat_state(again["params"]), strict=True):
    np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value()), err_msg=str(path))
  for a, b in zip(jax.tree.leaves(state["opt_state"]), jax.tree.leaves(again["opt_state"]), strict=True):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_pipeline_parallel_layers_loss_and_gradients_equal_one_device():
  """The first half of a mixtral-like model's layers pipelined (expert=2 in the stages), the rest after the pipeline:
  the loss (load balance over both stacks included) and gradients of the unpipelined model on one device."""
  config = config_for(
    "mixtral", ici_pipeline_parallelism=2, ici_expert_parallelism=2, ici_fsdp_parallelism=2, pipeline_parallel_layers=4, num_pipeline_microbatches=4
  )
  plan = pipeline_specs.pipeline_plan(config)
  assert (plan.layers, plan.outside, plan.repeats) == (4, 4, 2)
  assert "pipeline: 4 of 8 layers pipelined (4 after them run on every stage)" in pipeline.banner(pipeline_specs.pipeline_plan(config))
  rules = dict((name, axes) for name, axes in config.logical_axis_rules)
  assert rules["layers"] == ["stage"] and rules["layers_outside_pipeline"] == []
  one_device = from_overrides(num_devices=1, **{**SMALL, **MODELS["mixtral"], "per_device_batch_size": 8 * SMALL["per_device_batch_size"]})
  ref_loss, ref_grads = loss_and_grads("mixtral", one_device)  # the same global batch
  loss, grads = loss_and_grads("mixtral", config)
  assert loss == pytest.approx(ref_loss, rel=1e-5)
  assert grads.keys() == ref_grads.keys()
  assert_gradients_close(grads, ref_grads)


def test_pipeline_parallel_layers_trains_like_unpipelined(trained):
  (config, _, first, state), (pp_config, _, pp_first, pp_state) = trained["plain"], trained["partial"]
  for key in ("loss", "grad_norm"):
    assert float(pp_first[key]) == pytest.approx(float(first[key]), rel=1e-5), key
  ref, got = plain_params(state, config), plain_params(pp_state, pp_config)
  assert ref.keys() == got.keys()
  for name, value in ref.items():
    assert np.linalg.norm(got[name] - value) <= 1e-5 * np.linalg.norm(value), name


def test_pipeline_parallel_layers_checkpoint_resumes_on_one_device_and_back(trained, tmp_path_factory):
  """Saved with pipeline_parallel_layers on the stage mesh, restored by an unpipelined single-device run: the same
  parameters and optimizer state in plain layer order, bitwise; saved there and restored under the pipeline: the
  pipelined run's train state, bitwise."""
  from maxtext.train import setup as setup_lib
  from maxtext.train.checkpointing import Checkpointer

  pp_config, pp_setup, _, pp_state = trained["partial"]
  Checkpointer(pp_config).save(10, pp_state, None)
  one = from_overrides(num_devices=1, **{**SMALL, **MODELS["llama"], **TRAIN, "per_device_batch_size": 8 * SMALL["per_device_batch_size"]})
  one = one.model_copy(update={"checkpoint_dir": str(tmp_path_factory.mktemp("one") / "checkpoints")})
  one_setup = setup_lib.build(one, mesh_lib.create(one, jax.devices()[:1]))
  with jax.set_mesh(one_setup.mesh):
    restored = Checkpointer(one.model_copy(update={"checkpoint_dir": pp_config.checkpoint_dir})).restore_latest(one_setup.abstract_state).state
  expected = pipeline.to_storage(pp_state, pipeline_specs.pipeline(pp_config))
  joined = [x for x in jax.tree.leaves(expected["params"]) if x.ndim > 1 and x.shape[0] == pp_config.num_decoder_layers]
  assert joined and all("stage" in str(x.sharding.spec) for x in joined)  # the joined stack stays split over the stages
  for key in ("params", "opt_state"):
    for a, b in zip(jax.tree.leaves(expected[key]), jax.tree.leaves(restored[key]), strict=True):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  Checkpointer(one).save(10, restored, None)
  with jax.set_mesh(pp_setup.mesh):
    again = Checkpointer(pp_config.model_copy(update={"checkpoint_dir": one.checkpoint_dir})).restore_latest(pp_setup.abstract_state).state
  assert jax.tree.structure(again["params"]) == jax.tree.structure(pp_state["params"])
  for key in ("params", "opt_state"):
    for a, b in zip(jax.tree.leaves(pp_state[key]), jax.tree.leaves(again[key]), strict=True):
      assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
