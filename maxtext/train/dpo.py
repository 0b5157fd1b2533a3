"""Direct preference optimisation (Rafailov et al. 2023) as a train-step objective.

Rows hold whole preference pairs (maxtext.data.preference): pair k of a row is segment 2k - 1 (the chosen
response, with its prompt) and segment 2k (the rejected one); `targets_segmentation` is nonzero only on
response tokens. With log pi(y|x) the summed log-probability of a response's tokens under the policy and
log pi_ref(y|x) under the reference model (maxtext.train.reference; computed in the same step, without
gradient), for chosen y_w and rejected y_l:

    r_w = beta (log pi(y_w|x) - log pi_ref(y_w|x)),   r_l = beta (log pi(y_l|x) - log pi_ref(y_l|x))
    Delta = r_w - r_l
    loss = mean over pairs of  -(1 - eps) log sigmoid(Delta) - eps log sigmoid(-Delta)     (eps: dpo_label_smoothing)

Metrics: rewards/chosen = mean r_w, rewards/rejected = mean r_l, rewards/accuracy = mean [r_w > r_l] (a tie, as at
the first step where the policy is the reference, counts one half),
rewards/margin = mean (r_w - r_l); total_weights is the number of pairs (the loss's normaliser).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from maxtext.train.loss import token_log_probs
from maxtext.train.objective import SummedTerms

Batch = dict[str, jax.Array]


def segment_sums(values: jax.Array, segments: jax.Array) -> jax.Array:
  """values [B, S] summed per segment id of each row -> [B, S + 1] (column j: segment j; column 0: unused positions)."""
  b, s = segments.shape
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
  return jnp.zeros((b, s + 1), jnp.float32).at[rows, segments].add(values.astype(jnp.float32))


def pair_sums(values: jax.Array, segments: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum over each pair's chosen response, over its rejected response), each [B, S // 2]: pair k is segments
  2k + 1 (chosen) and 2k + 2 (rejected) of its row."""
  sums = segment_sums(values, segments)
  pairs = segments.shape[1] // 2
  return sums[:, 1 : 2 * pairs : 2], sums[:, 2 : 2 * pairs + 1 : 2]


def pair_mask(targets_segmentation: jax.Array) -> jax.Array:
  """[B, S // 2] float: 1 where both responses of the pair have tokens to score."""
  chosen, rejected = pair_sums(jnp.ones_like(targets_segmentation), targets_segmentation)
  return ((chosen > 0) & (rejected > 0)).astype(jnp.float32)


def dpo_terms(policy_lp: jax.Array, reference_lp: jax.Array, targets_segmentation: jax.Array, beta: float, label_smoothing: float) -> dict[str, jax.Array]:
  """Sums over the batch's pairs of the DPO loss and its reward statistics, from per-token log-probabilities [B, S]."""
  mask = targets_segmentation != 0
  ratio = jnp.where(mask, policy_lp - reference_lp, 0.0)
  chosen, rejected = pair_sums(ratio, targets_segmentation)
  valid = pair_mask(targets_segmentation)
  r_w, r_l = beta * chosen, beta * rejected
  delta = r_w - r_l
  losses = (1.0 - label_smoothing) * jax.nn.softplus(-delta) + label_smoothing * jax.nn.softplus(delta)
  return {
    "loss": jnp.sum(losses * valid),
    "pairs": jnp.sum(valid),
    "chosen": jnp.sum(r_w * valid),
    "rejected": jnp.sum(r_l * valid),
    "correct": jnp.sum(jnp.where(delta == 0, 0.5, (delta > 0).astype(jnp.float32)) * valid),  # a tie is half right
    "margin": jnp.sum(delta * valid),
  }


class DPO(SummedTerms):
  """The DPO objective (see the module docstring): loss = sum of pair losses / pairs of the batch + mean MoE aux."""

  TERMS = ("loss", "pairs", "chosen", "rejected", "correct", "margin")
  uses_reference = True
  iterations = 1
  extra_batch: dict[str, tuple[bool, Any]] = {}

  def weight(self, batch: Batch) -> jax.Array:
    return jnp.maximum(jnp.sum(pair_mask(batch["targets_segmentation"])), 1.0)

  def sums(self, policy: Any, reference: Any, batch: Batch, training: bool) -> dict[str, jax.Array]:
    policy_lp, stats = token_log_probs(policy, batch)
    reference_lp, _ = token_log_probs(reference, batch)
    c = self.config
    return self.with_moe(dpo_terms(policy_lp, jax.lax.stop_gradient(reference_lp), batch["targets_segmentation"], c.dpo_beta, c.dpo_label_smoothing), stats)

  def metrics(self, sums: dict[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
    return {
      **{f"rewards/{k}": sums[k] / weight for k in ("chosen", "rejected", "margin")},
      "rewards/accuracy": sums["correct"] / weight,
      "moe_lb_loss": self.mean_aux(sums),
      "total_weights": sums["pairs"],
    }

  def combine_eval(self, sums: list[dict[str, Any]]) -> dict[str, float]:
    pairs = max(sum(float(s["pairs"]) for s in sums), 1.0)
    total = {k: sum(float(s[k]) for s in sums) for k in ("loss", "chosen", "rejected", "correct", "margin")}
    aux = sum(float(s["aux"]) for s in sums) / max(len(sums), 1)
    return {
      "eval_loss": total["loss"] / pairs + aux,
      "eval_total_weights": pairs,
      **{f"eval_rewards/{k}": total[k] / pairs for k in ("chosen", "rejected", "margin")},
      "eval_rewards/accuracy": total["correct"] / pairs,
    }
