"""The pure train and eval steps: (state, batch) -> (state, metrics), built once per run.

What a step minimises is its `Objective` (maxtext.train.objective): next-token cross entropy (`LanguageModel`,
pretraining and SFT), DPO (maxtext.train.dpo) or GRPO (maxtext.train.grpo). The step around it is shared: gradient
accumulation over micro-batches, the optimizer update at the schedule's rate, spike skipping and the MoE
routing-bias update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from maxtext.config import MaxTextConfig
from maxtext.layers.moe import update_routing_biases
from maxtext.models import layer_pattern, registry
from maxtext.train import loss as loss_lib
from maxtext.train import reference as reference_lib
from maxtext.train.objective import Batch, Metrics, Objective
from maxtext.train.schedules import learning_rate_schedule
from maxtext.train.state import TrainState
from maxtext.train.trainable import split_params


class LanguageModel:
  """Next-token cross entropy, token-weighted, plus z-loss, multi-token prediction and the MoE load-balance loss:
  loss = (sum xent + sum z + sum mtp + sum indexer KL) / real target tokens + mean MoE aux."""

  uses_reference = False
  iterations = 1
  extra_batch: dict[str, tuple[bool, Any]] = {}

  def __init__(self, config: MaxTextConfig):
    self.config = config

  def weight(self, batch: Batch) -> jax.Array:
    return jnp.maximum(jnp.sum(batch["targets_segmentation"] != 0).astype(jnp.float32), 1.0)

  def sums(self, policy: Any, reference: Any, batch: Batch, training: bool) -> loss_lib.LossSums:
    return loss_lib.loss_sums(policy, batch, self.config, training=training)

  def zero_sums(self) -> loss_lib.LossSums:
    return loss_lib.zero_sums(self.config)

  def loss(self, sums: loss_lib.LossSums, weight: jax.Array) -> jax.Array:
    return (sums.xent + sums.z_loss + sums.mtp + sums.indexer) / weight + sums.aux / self.config.gradient_accumulation_steps

  def metrics(self, sums: loss_lib.LossSums, weight: jax.Array) -> Metrics:
    c = self.config
    return {
      "z_loss": sums.z_loss / weight,
      "moe_lb_loss": sums.aux / c.gradient_accumulation_steps,
      **({"mtp_loss": sums.mtp / weight} if c.mtp_num_layers else {}),
      **({"indexer_loss": sums.indexer / weight} if c.use_indexer and c.indexer_loss_scaling_factor > 0 else {}),
      **({"moe_dropped_tokens": sums.dropped} if (c.capacity_factor > 0 or c.ragged_buffer_factor > 0) and c.num_experts > 1 else {}),
      "total_weights": sums.weights,
    }

  def routing_load(self, sums: loss_lib.LossSums) -> jax.Array:
    return sums.load

  def combine_eval(self, sums: list[dict[str, Any]]) -> dict[str, float]:
    return combine_eval(sums)


def objective_for(config: MaxTextConfig) -> Objective:
  """The objective config selects: DPO (use_dpo), GRPO (use_grpo) or next-token prediction."""
  if config.use_dpo:
    from maxtext.train.dpo import DPO

    return DPO(config)
  if config.use_grpo:
    from maxtext.train.grpo import GRPO

    return GRPO(config)
  return LanguageModel(config)


def _expert_slots(config: MaxTextConfig) -> list[tuple[str, int | None]] | None:
  """Where the routing-load rows' layers keep their parameters, for a family whose leading layers have experts too
  (DeepSeek V4: its load rows are every layer, its first ones a stack of their own); None: the rows follow the main stack."""
  family = registry.get(config.decoder_block)
  if not family.deepseek4_keys:
    return None
  kinds = family.kinds(config)
  return [slot for kind, slot in zip(kinds, layer_pattern.parameter_slots(kinds, config.scan_layers)) if kind.ffn != "dense"]


def _micro_batches(batch: Batch, steps: int) -> Batch:
  """[steps*m, S] -> [steps, m, S]; micro-batch j holds rows i*steps + j so every device keeps its rows."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1), batch)


def _spike_check(spike: dict[str, jax.Array], loss: jax.Array, config: MaxTextConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Is this loss a spike (above mean + factor * std of the last skip_step_interval losses, or non-finite)?"""
  window, count = spike["losses"], spike["count"]
  full = count >= config.skip_step_interval
  threshold = jnp.mean(window) + config.skip_step_scaling_factor * jnp.std(window)
  skip = jnp.logical_or(~jnp.isfinite(loss), jnp.logical_and(full, loss > threshold))
  new_window = jnp.where(skip, window, window.at[count % config.skip_step_interval].set(loss))
  return skip, {"losses": new_window, "count": jnp.where(skip, count, count + 1)}


def _make_update(config: MaxTextConfig, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, objective: Objective) -> Callable:
  """One optimizer update: (state, batch, weight, lr) -> (state, metrics), gradients summed over
  gradient_accumulation_steps micro-batches; spike skipping and the routing-bias update included."""
  accum = config.gradient_accumulation_steps

  def grad_objective(trainable, frozen, other, reference_trainable, batch, weight):
    policy = nnx.merge(graphdef, trainable, frozen, other)
    reference = None if reference_trainable is None else nnx.merge(graphdef, jax.lax.stop_gradient(reference_trainable), frozen, other)
    sums = objective.sums(policy, reference, batch, True)
    return objective.loss(sums, weight), sums

  grad_fn = jax.value_and_grad(grad_objective, has_aux=True)

  def update(state: TrainState, batch: Batch, weight: jax.Array, lr: jax.Array) -> tuple[TrainState, Metrics]:
    trainable, frozen = split_params(state["params"], config)
    other = state.get("other", nnx.State({}))
    reference_trainable = reference_lib.reference_trainable(config, state, trainable) if objective.uses_reference else None
    if accum == 1:
      (_, sums), grads = grad_fn(trainable, frozen, other, reference_trainable, batch, weight)
    else:

      def micro_step(carry, micro):
        g_acc, s_acc = carry
        (_, s), g = grad_fn(trainable, frozen, other, reference_trainable, micro, weight)
        return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, s)), None

      zeros = jax.tree.map(jnp.zeros_like, trainable)
      (grads, sums), _ = jax.lax.scan(micro_step, (zeros, objective.zero_sums()), _micro_batches(batch, accum))
    # The norm and the update both read every gradient. Without the barrier XLA fuses the slice that keeps this
    # device's shard of a batch-summed gradient into both readers, and the whole sum (the full float32 [emb, vocab]
    # output-kernel gradient) stays alive until the update (figure: benchmarks/README.md, figures behind code comments).
    grads = jax.lax.optimization_barrier(grads)
    loss = objective.loss(sums, weight)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], trainable)
    new_trainable = optax.apply_updates(trainable, jax.tree.map(lambda u: lr * u, updates))
    new_state = dict(state, params=nnx.merge_state(new_trainable, frozen), opt_state=opt_state)
    if config.routed_bias_update_rate > 0:
      new_state["other"] = update_routing_biases(other, objective.routing_load(sums), config.routed_bias_update_rate, config.scan_layers, _expert_slots(config))
    metrics = {"loss": loss, **objective.metrics(sums, weight), "grad_norm": grad_norm, "lr": lr}
    if config.skip_step_on_spikes:
      skip, new_state["spike"] = _spike_check(state["spike"], loss, config)
      for key in ("params", "opt_state", "other") if "other" in state else ("params", "opt_state"):
        new_state[key] = jax.tree.map(lambda new, old: jnp.where(skip, old, new), new_state[key], state[key])
      metrics["skipped"] = skip.astype(jnp.float32)
    return new_state, metrics

  return update


def make_train_step(
  config: MaxTextConfig,
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  objective: Objective | None = None,
  opt_state_on_device: Any = None,
) -> Callable:
  """The pure train step: gradients weighted by objective.weight over gradient_accumulation_steps micro-batches,
  objective.iterations updates on the batch at the learning rate of state['step'], which then advances by one.

  opt_state_on_device: given when the optimizer state arrives in host memory (optimizer_memory_host_offload), its
  shardings on the device: the update copies it there, and the jit's out_shardings return the new state to the host."""
  objective = objective or objective_for(config)
  schedule = learning_rate_schedule(config)
  update = _make_update(config, graphdef, optimizer, objective)

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      weight = objective.weight(batch)
      lr = schedule(state["step"])
      if opt_state_on_device is not None:
        # One copy for the step's updates, which XLA schedules: tied to the finished gradients by a barrier it
        # measured more device memory (benchmarks/README.md, "Optimizer state in host memory").
        state = dict(state, opt_state=jax.device_put(state["opt_state"], opt_state_on_device))
      if objective.iterations == 1:
        new_state, metrics = update(state, batch, weight, lr)
      else:  # several updates on one batch: metrics are their means

        def one(s, _):
          return update(s, batch, weight, lr)

        new_state, per_update = jax.lax.scan(one, state, length=objective.iterations)
        metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), per_update)
      return dict(new_state, step=state["step"] + 1), metrics

  return train_step


def make_eval_step(config: MaxTextConfig, graphdef: nnx.GraphDef, mesh: Mesh, objective: Objective | None = None) -> Callable:
  """(params, other, reference, batch) -> the objective's sums over one eval batch (reference: the state's
  'reference' entry, an empty State when it has none)."""
  objective = objective or objective_for(config)

  def eval_step(params: nnx.State, other: nnx.State, reference: nnx.State, batch: Batch) -> Any:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      policy = nnx.merge(graphdef, params, other)
      ref_model = None
      if objective.uses_reference:
        trainable, frozen = split_params(params, config)
        ref_trainable = reference_lib.reference_trainable(config, {"reference": reference}, trainable)
        ref_model = nnx.merge(graphdef, ref_trainable, frozen, other)
      sums = objective.sums(policy, ref_model, batch, False)
      return sums._asdict() if hasattr(sums, "_asdict") else sums

  return eval_step


def combine_eval(sums: list[dict[str, Any]]) -> dict[str, float]:
  """Eval loss over several batches, computed like the train loss: token-weighted, plus mean aux."""
  xent = sum(float(s["xent"]) for s in sums)
  z = sum(float(s["z_loss"]) for s in sums)
  weights = max(sum(float(s["weights"]) for s in sums), 1.0)
  aux = sum(float(s["aux"]) for s in sums) / max(len(sums), 1)
  return {"eval_loss": (xent + z) / weights + aux, "eval_total_weights": weights}
