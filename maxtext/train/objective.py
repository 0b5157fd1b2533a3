"""What a train step minimises: the `Objective` seam of maxtext.train.step, and `SummedTerms`, the base of the
post-training objectives (DPO: maxtext.train.dpo, GRPO: maxtext.train.grpo)."""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from maxtext.config import MaxTextConfig

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


class Objective(Protocol):
  """What a train step minimises, as sums over a (micro-)batch divided by a weight counted over the whole batch."""

  uses_reference: bool  # the step builds the reference model (maxtext.train.reference) and passes it to `sums`
  iterations: int  # optimizer updates per batch (GRPO's num_iterations), all at the step's learning rate
  extra_batch: dict[str, tuple[bool, Any]]  # batch keys beside the token rows: key -> (per token (else per row), dtype)

  def weight(self, batch: Batch) -> jax.Array:
    """The normaliser of the whole batch (real target tokens, pairs, sequences), counted before micro-batching."""

  def sums(self, policy: Any, reference: Any, batch: Batch, training: bool) -> Any:
    """A pytree of float32 sums over the batch's rows; `reference` is None unless uses_reference."""

  def zero_sums(self) -> Any:
    """Zeros shaped like `sums` (the start of gradient accumulation)."""

  def loss(self, sums: Any, weight: jax.Array) -> jax.Array:
    """The scalar minimised, from one micro-batch's sums (its gradient) or the whole batch's (the reported loss)."""

  def metrics(self, sums: Any, weight: jax.Array) -> Metrics:
    """Per-step metrics beside loss, grad_norm and lr (total_weights among them)."""

  def routing_load(self, sums: Any) -> jax.Array:
    """[MoE layers, num_experts] tokens routed in the forward pass (the aux-loss-free bias update reads it)."""

  def combine_eval(self, sums: list[dict[str, Any]]) -> dict[str, float]:
    """Eval metrics over several batches' sums: at least eval_loss and eval_total_weights."""


class SummedTerms:
  """Base of the post-training objectives: sums are a dict of float32 terms (their `loss` term summed over the
  batch) plus the policy forward's MoE load-balance loss `aux` and routing `load`; loss = loss / weight + mean aux."""

  TERMS: tuple[str, ...] = ("loss",)  # the objective's summed terms

  def __init__(self, config: MaxTextConfig):
    self.config = config

  def with_moe(self, terms: dict[str, jax.Array], stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {**terms, "aux": jnp.asarray(stats["lb_loss"], jnp.float32), "load": jnp.asarray(stats["load"], jnp.float32)}

  def zero_sums(self) -> dict[str, jax.Array]:
    c = self.config
    zero = jnp.zeros((), jnp.float32)
    return {**{k: zero for k in (*self.TERMS, "aux")}, "load": jnp.zeros((c.num_decoder_layers - c.first_num_dense_layers, c.num_experts), jnp.float32)}

  def loss(self, sums: dict[str, jax.Array], weight: jax.Array) -> jax.Array:
    return sums["loss"] / weight + self.mean_aux(sums)

  def mean_aux(self, sums: dict[str, jax.Array]) -> jax.Array:
    return sums["aux"] / self.config.gradient_accumulation_steps

  def routing_load(self, sums: dict[str, jax.Array]) -> jax.Array:
    return sums["load"]
