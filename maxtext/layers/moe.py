"""Mixture of experts with top-k routing (Mixtral), exact and dropless, with a load-balance loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.config import MaxTextConfig
from maxtext.layers.dtypes import dtype, precision
from maxtext.layers.linear import DenseGeneral, variance_scaling_init
from maxtext.layers.mlp import activation
from maxtext.platform import Policy


def route(router_logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Softmax router (float32), top-k renormalised. Returns (weights [T,k], experts [T,k], probs [T,E])."""
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts, probs


def load_balance_loss(probs: jax.Array, experts: jax.Array, valid: jax.Array) -> jax.Array:
  """Switch-style auxiliary loss: E * sum_e (fraction of routed slots to e) * (mean router prob of e), over valid tokens."""
  num_experts = probs.shape[-1]
  w = valid.astype(jnp.float32)[:, None]
  denom = jnp.maximum(jnp.sum(w), 1.0)
  chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=1)  # [T,E]
  frac = jnp.sum(chosen * w, axis=0) / (denom * experts.shape[-1])
  mean_prob = jnp.sum(probs * w, axis=0) / denom
  return num_experts * jnp.sum(frac * mean_prob)


class MoE(nnx.Module):
  """Experts' weights stacked [num_experts, ...]. Every routed token is computed exactly (no capacity, no dropping)."""

  def __init__(self, config: MaxTextConfig, *, policy: Policy, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.dtype = dtype(c.dtype)
    self.precision = precision(c.matmul_precision)
    wdt = dtype(c.weight_dtype)
    e, m, n = c.emb_dim, c.mlp_dim, c.num_experts
    self.gate = DenseGeneral(
      (e,), (n,), ("embed", None), dtype=jnp.float32, weight_dtype=wdt, precision=self.precision, rngs=rngs, integer_rounding=policy.integer_bf16_rounding
    )
    self.wi_0 = nnx.Param(variance_scaling_init(rngs.params(), (n, e, m), e, wdt), logical_axes=("exp", "embed", "mlp"))
    self.wi_1 = nnx.Param(variance_scaling_init(rngs.params(), (n, e, m), e, wdt), logical_axes=("exp", "embed", "mlp"))
    self.wo = nnx.Param(variance_scaling_init(rngs.params(), (n, m, e), m, wdt), logical_axes=("exp", "mlp", "embed"))

  def __call__(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B,S,E], valid [B,S] bool (tokens counted in the load-balance loss) -> (y [B,S,E], aux loss).

    Dropless: each (token, chosen expert) pair is sorted by expert and the experts run as
    grouped matmuls (jax.lax.ragged_dot), so compute is proportional to num_experts_per_tok.
    """
    c = self.config
    b, s, e = x.shape
    k = c.num_experts_per_tok
    tokens = x.reshape(b * s, e).astype(self.dtype)
    weights, experts, probs = route(self.gate(tokens), k)
    aux = load_balance_loss(probs, experts, valid.reshape(-1))
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    group_sizes = jnp.bincount(flat_experts, length=c.num_experts).astype(jnp.int32)
    routed = tokens[order // k]  # [T*k, E], grouped by expert

    def grouped(lhs: jax.Array, w: nnx.Param) -> jax.Array:
      return jax.lax.ragged_dot(lhs, w[...].astype(self.dtype), group_sizes, precision=self.precision)

    h0 = checkpoint_name(grouped(routed, self.wi_0), "mlpwi_0")
    h1 = checkpoint_name(grouped(routed, self.wi_1), "mlpwi_1")
    h = activation(c.mlp_activations[0])(h0) * activation(c.mlp_activations[-1])(h1)
    out = grouped(h, self.wo)  # [T*k, E]
    slots = jnp.zeros_like(out).at[order].set(out).reshape(b * s, k, e)
    y = jnp.einsum("tke,tk->te", slots.astype(jnp.float32), weights).astype(self.dtype)
    return checkpoint_name(y.reshape(b, s, e), "mlpwo"), aux
