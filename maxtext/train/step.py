"""The pure train and eval steps: (state, batch) -> (state, metrics), built once per run."""

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
from maxtext.train import loss as loss_lib
from maxtext.train.schedules import learning_rate_schedule
from maxtext.train.state import TrainState, split_params

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


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


def make_train_step(config: MaxTextConfig, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, mesh: Mesh) -> Callable:
  """The pure train step. Gradients are token-weighted over gradient_accumulation_steps micro-batches."""
  schedule = learning_rate_schedule(config)
  accum = config.gradient_accumulation_steps

  def objective(trainable, frozen, other, batch, total_weights):
    model = nnx.merge(graphdef, trainable, frozen, other)
    sums = loss_lib.loss_sums(model, batch, config)
    return (sums.xent + sums.z_loss + sums.mtp) / total_weights + sums.aux / accum, sums

  grad_fn = jax.value_and_grad(objective, has_aux=True)

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      trainable, frozen = split_params(state["params"], config)
      other = state.get("other", nnx.State({}))
      total_weights = jnp.maximum(jnp.sum(batch["targets_segmentation"] != 0).astype(jnp.float32), 1.0)
      if accum == 1:
        (_, sums), grads = grad_fn(trainable, frozen, other, batch, total_weights)
      else:

        def micro_step(carry, micro):
          g_acc, s_acc = carry
          (_, s), g = grad_fn(trainable, frozen, other, micro, total_weights)
          return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, s)), None

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        (grads, sums), _ = jax.lax.scan(micro_step, (zeros, loss_lib.zero_sums(config)), _micro_batches(batch, accum))
      # The norm and the update both read every gradient. Without the barrier XLA fuses the slice that keeps this
      # device's shard of a batch-summed gradient into both readers, and the whole sum (the full float32 [emb, vocab]
      # output-kernel gradient) stays alive until the update (figure: benchmarks/README.md, figures behind code comments).
      grads = jax.lax.optimization_barrier(grads)
      aux = sums.aux / accum
      loss = (sums.xent + sums.z_loss + sums.mtp) / total_weights + aux
      grad_norm = optax.tree.norm(grads)
      lr = schedule(state["step"])
      updates, opt_state = optimizer.update(grads, state["opt_state"], trainable)
      new_trainable = optax.apply_updates(trainable, jax.tree.map(lambda u: lr * u, updates))
      new_state = dict(state, step=state["step"] + 1, params=nnx.merge_state(new_trainable, frozen), opt_state=opt_state)
      if config.routed_bias_update_rate > 0:
        new_state["other"] = update_routing_biases(other, sums.load, config)
      metrics = {
        "loss": loss,
        "z_loss": sums.z_loss / total_weights,
        "moe_lb_loss": aux,
        **({"mtp_loss": sums.mtp / total_weights} if config.mtp_num_layers else {}),
        **({"moe_dropped_tokens": sums.dropped} if config.capacity_factor > 0 and config.num_experts > 1 else {}),
        "total_weights": sums.weights,
        "grad_norm": grad_norm,
        "lr": lr,
      }
      if config.skip_step_on_spikes:
        skip, new_state["spike"] = _spike_check(state["spike"], loss, config)
        for key in ("params", "opt_state", "other") if "other" in state else ("params", "opt_state"):
          new_state[key] = jax.tree.map(lambda new, old: jnp.where(skip, old, new), new_state[key], state[key])
        metrics["skipped"] = skip.astype(jnp.float32)
      return new_state, metrics

  return train_step


def make_eval_step(config: MaxTextConfig, graphdef: nnx.GraphDef, mesh: Mesh) -> Callable:
  """(params, other, batch) -> summed losses of one eval batch."""

  def eval_step(params: nnx.State, other: nnx.State, batch: Batch) -> Metrics:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      sums = loss_lib.loss_sums(nnx.merge(graphdef, params, other), batch, config, training=False)
      return sums._asdict()

  return eval_step


def combine_eval(sums: list[dict[str, Any]]) -> dict[str, float]:
  """Eval loss over several batches, computed like the train loss: token-weighted, plus mean aux."""
  xent = sum(float(s["xent"]) for s in sums)
  z = sum(float(s["z_loss"]) for s in sums)
  weights = max(sum(float(s["weights"]) for s in sums), 1.0)
  aux = sum(float(s["aux"]) for s in sums) / max(len(sums), 1)
  return {"eval_loss": (xent + z) / weights + aux, "eval_total_weights": weights}
