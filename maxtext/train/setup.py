"""Everything a run compiles, built without allocating parameters: `build(config, mesh) -> TrainSetup`.

`setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile()` is exactly what
train runs and what AOT compilation (maxtext.train_compile) checks. On TPU the platform policy leaves the
state's device layouts to XLA (`compiler_state_layouts`): the compiled step then says, in
`state_lib.compiled_formats(compiled)`, the layouts the state must be created in (`init_state(formats)`)
or moved to (`state_lib.placed`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtext import mesh as mesh_lib
from maxtext import platform
from maxtext.config import MaxTextConfig
from maxtext.data import image_text
from maxtext.data.features import IMAGE_KEY
from maxtext.data.synthetic import BATCH_KEYS
from maxtext.errors import ConfigError
from maxtext.models import common_specs, vision_specs
from maxtext.train import diloco, optimizers, reference
from maxtext.train import state as state_lib
from maxtext.train import step as step_lib
from maxtext.train.objective import Objective

ModelBuilder = Callable[[MaxTextConfig, nnx.Rngs], nnx.Module]


def default_model_builder(policy: platform.Policy) -> ModelBuilder:
  from maxtext import models

  return functools.partial(models.build, policy=policy)


@dataclasses.dataclass
class TrainSetup:
  config: MaxTextConfig
  mesh: Mesh
  graphdef: nnx.GraphDef
  abstract_state: Any  # ShapeDtypeStructs with .sharding
  abstract_batch: dict[str, jax.ShapeDtypeStruct]
  state_shardings: Any
  batch_shardings: dict[str, NamedSharding]
  jit_step: Any  # jax.jit(train_step), donates the state; under compiler_state_layouts only .lower().compile() runs it
  jit_eval: Any  # jax.jit(eval_step): (params, other, reference, batch) -> the objective's sums
  init_fn: Callable[[], state_lib.TrainState]
  policy: platform.Policy  # the platform policy the model and step were built with
  objective: Objective  # what the step minimises (next-token loss, DPO, GRPO)

  @functools.cached_property
  def jit_init(self) -> Any:
    return jax.jit(self.init_fn, out_shardings=self.state_shardings)

  @functools.cached_property
  def compiled_step(self) -> Any:
    """jit_step compiled for abstract_state and abstract_batch (its memory_analysis() is what a step needs)."""
    return self.jit_step.lower(self.abstract_state, self.abstract_batch).compile()

  def abstract_eval_batch(self, rows: int) -> dict[str, jax.ShapeDtypeStruct]:
    """An eval batch of `rows` rows (global_batch_size_to_eval_on): abstract_batch with that many rows."""
    return {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype, sharding=v.sharding) for k, v in self.abstract_batch.items()}

  def eval_arguments(self, state: Any) -> tuple[Any, Any, Any]:
    """The parts of a train state (or its abstract form) that the eval step reads: params, other, reference."""
    return state["params"], state.get("other", nnx.State({})), state.get(reference.KEY, nnx.State({}))

  def compiled_eval(self, rows: int) -> Any:
    """jit_eval compiled for abstract_state's parameters and an eval batch of `rows` rows (its memory_analysis() is
    what an eval batch needs); jit_eval's later calls on batches of that shape reuse the compilation."""
    return self.jit_eval.lower(*self.eval_arguments(self.abstract_state), self.abstract_eval_batch(rows)).compile()

  @functools.cached_property
  def rollout(self) -> Any:
    """GRPO: the rollout decoder over this setup's parameters (maxtext.inference.rollout), compiled per prompt bucket on first use."""
    from maxtext.data.pipeline import resolve_tokenizer
    from maxtext.inference.rollout import Rollout

    other = self.abstract_state.get("other", nnx.State({}))
    tokenizer = resolve_tokenizer(self.config)
    return Rollout(self.config, self.graphdef, self.abstract_state["params"], other, self.mesh, tokenizer.eos_id, tokenizer.vocab_size)

  @functools.cached_property
  def score_fn(self) -> Any:
    """GRPO: the jitted forward giving a rollout batch's old and reference log-probabilities (None when it needs neither)."""
    from maxtext.train.grpo import make_score_fn

    return make_score_fn(self.config, self)

  def init_state(self, formats: Any = None) -> state_lib.TrainState:
    """The fresh initial state, born sharded (parameters never exist unsharded); given formats (a compiled
    step's `state_lib.compiled_formats`), born in that step's device layouts too."""
    if formats is None:
      return self.jit_init()
    return jax.jit(self.init_fn, out_shardings=formats)()

  def init_params(self) -> Any:
    """Only the seeded initial parameters, born sharded (the rest of the state is never built)."""
    return jax.jit(lambda: self.init_fn()["params"], out_shardings=self.state_shardings["params"])()

  def param_shardings(self) -> Any:
    return self.state_shardings["params"]

  def eval_on(self, state: state_lib.TrainState, batch: dict[str, jax.Array]) -> Any:
    """The objective's sums over one eval batch, for the parameters of `state`."""
    return self.jit_eval(*self.eval_arguments(state), batch)


def _input_batch(config: MaxTextConfig, data: NamedSharding, rows: NamedSharding) -> tuple[dict[str, Any], dict[str, jax.ShapeDtypeStruct]]:
  """The step's batch keys beyond the objective's: tokens, adapter ids and images (shardings, abstract arrays)."""
  batch_shardings = {k: data for k in BATCH_KEYS}
  shape = (config.global_batch_size_to_train_on, config.max_target_length)
  abstract_batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=data) for k in BATCH_KEYS}
  if config.lora.enable_lora and config.lora.max_lora_adapters > 1 and config.lora.adapter_column:  # each token's adapter slot, from the data
    batch_shardings["adapter_ids"] = data
    abstract_batch["adapter_ids"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=data)
  elif config.lora.enable_lora and config.lora.max_lora_adapters > 1:  # each row's adapter slot, from the caller's batches
    batch_shardings["adapter_ids"] = rows
    abstract_batch["adapter_ids"] = jax.ShapeDtypeStruct(shape[:1], jnp.int32, sharding=rows)
  if config.use_multimodal and config.dataset_type != "synthetic" and config.vision_encoder_block == "qwen3_vl":  # each row's patches, layout, MRoPE positions
    from maxtext.data import qwen3_vl_records

    layout = common_specs.context_layout(config)
    if layout is not None and layout.load_balance:  # the rows' MRoPE positions and image places stay in natural order
      raise ConfigError("training Qwen3-VL on image-text records keeps each row in order; set context_parallel_load_balance=false")
    vision = vision_specs.vision(config)
    for key, (row_shape, dtype) in qwen3_vl_records.batch_layout(vision, qwen3_vl_records.patch_budget(config, vision), config.max_target_length).items():
      batch_shardings[key] = data
      abstract_batch[key] = jax.ShapeDtypeStruct((shape[0], *row_shape), dtype, sharding=data)
  elif config.use_multimodal and config.dataset_type != "synthetic":  # each token's chunk of its image (maxtext.data.image_text)
    vision = vision_specs.vision(config)
    chunk = (
      image_text.chunk_size(vision.tile_size, vision.tokens_per_image)
      if config.decoder_block == "llama4"
      else image_text.chunk_size(config.image_size_for_vit, config.mm_tokens_per_image)
    )
    batch_shardings[IMAGE_KEY] = data
    abstract_batch[IMAGE_KEY] = jax.ShapeDtypeStruct((*shape, chunk), jnp.uint8, sharding=data)
  return batch_shardings, abstract_batch


def build(config: MaxTextConfig, mesh: Mesh, build_model: ModelBuilder | None = None, policy: platform.Policy | None = None) -> TrainSetup:
  """policy defaults to the mesh's platform (maxtext.platform.resolve): a TPU topology mesh gets TPU kernels."""
  policy = policy or platform.resolve(config, mesh)
  build_model = build_model or default_model_builder(policy)
  optimizer = optimizers.build(config)
  init_fn = state_lib.make_init_fn(config, build_model, optimizer, config.init_weights_seed)
  abstract_model = nnx.eval_shape(lambda: build_model(config, nnx.Rngs(config.init_weights_seed)))
  graphdef = nnx.split(abstract_model, nnx.Param, ...)[0]

  abstract = jax.eval_shape(init_fn)
  state_shardings = state_lib.train_state_shardings(abstract, config, mesh)
  if config.enable_diloco:  # each group's state stacked over the 'diloco' axis, beside the global parameters
    outer = diloco.outer_optimizer(config)
    init_fn = diloco.make_init_fn(config, init_fn, outer)
    plain_shardings, abstract = state_shardings, jax.eval_shape(init_fn)
    state_shardings = diloco.state_shardings(config, mesh, abstract, plain_shardings)
  abstract_state = state_lib.with_shardings(abstract, state_shardings)
  data = mesh_lib.data_sharding(config, mesh)
  rows = NamedSharding(mesh, PartitionSpec(data.spec[0] if data.spec else None))
  batch_shardings, abstract_batch = _input_batch(config, data, rows)
  shape = (config.global_batch_size_to_train_on, config.max_target_length)
  objective = step_lib.objective_for(config)
  for key, (per_token, dt) in objective.extra_batch.items():
    batch_shardings[key] = data if per_token else rows
    abstract_batch[key] = jax.ShapeDtypeStruct(shape if per_token else shape[:1], dt, sharding=batch_shardings[key])
  replicated = NamedSharding(mesh, PartitionSpec())

  opt_on_device = state_lib.on_device(state_shardings["opt_state"]) if config.optimizer_memory_host_offload else None
  train_step = step_lib.make_train_step(config, graphdef, optimizer, mesh, objective, opt_on_device)
  metrics_out = replicated
  if config.enable_diloco:
    train_step, metrics_out = diloco.make_train_step(config, train_step, outer), diloco.metrics_sharding(mesh)
  step_state = state_lib.step_formats(state_shardings, policy.compiler_state_layouts)
  jit_step = jax.jit(train_step, in_shardings=(step_state, batch_shardings), out_shardings=(step_state, metrics_out), donate_argnums=0)
  eval_step = step_lib.make_eval_step(config, graphdef, mesh, objective)
  eval_in = (state_shardings["params"], state_shardings.get("other", nnx.State({})), state_shardings.get(reference.KEY, nnx.State({})), batch_shardings)
  jit_eval = jax.jit(eval_step, in_shardings=eval_in, out_shardings=replicated)
  return TrainSetup(config, mesh, graphdef, abstract_state, abstract_batch, state_shardings, batch_shardings, jit_step, jit_eval, init_fn, policy, objective)
