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
from maxtext.layers.sharding import constrain


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
  """Experts' weights stacked [E, ...]. Every token is computed exactly (no capacity, no dropping)."""

  def __init__(self, config: MaxTextConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.dtype = dtype(c.dtype)
    self.precision = precision(c.matmul_precision)
    wdt = dtype(c.weight_dtype)
    e, m, n = c.emb_dim, c.mlp_dim, c.num_experts
    self.gate = DenseGeneral((e,), (n,), ("embed", None), dtype=jnp.float32, weight_dtype=wdt, precision=self.precision, rngs=rngs)
    self.wi_0 = nnx.Param(variance_scaling_init(rngs.params(), (n, e, m), e, wdt), logical_axes=("exp", "embed", "mlp"))
    self.wi_1 = nnx.Param(variance_scaling_init(rngs.params(), (n, e, m), e, wdt), logical_axes=("exp", "embed", "mlp"))
    self.wo = nnx.Param(variance_scaling_init(rngs.params(), (n, m, e), m, wdt), logical_axes=("exp", "mlp", "embed"))

  def __call__(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B,S,E], valid [B,S] bool (tokens counted in the load-balance loss) -> (y [B,S,E], aux loss)."""
    c = self.config
    b, s, e = x.shape
    tokens = x.reshape(b * s, e)
    weights, experts, probs = route(self.gate(tokens), c.num_experts_per_tok)
    aux = load_balance_loss(probs, experts, valid.reshape(-1))
    # Combine weights [T, E]: zero for experts a token is not routed to.
    combine = jnp.sum(jax.nn.one_hot(experts, c.num_experts, dtype=jnp.float32) * weights[..., None], axis=1)
    h0 = jnp.einsum("te,nem->tnm", tokens.astype(self.dtype), self.wi_0[...].astype(self.dtype), precision=self.precision)
    h1 = jnp.einsum("te,nem->tnm", tokens.astype(self.dtype), self.wi_1[...].astype(self.dtype), precision=self.precision)
    h0, h1 = checkpoint_name(h0, "mlpwi_0"), checkpoint_name(h1, "mlpwi_1")
    h = activation(c.mlp_activations[0])(h0) * activation(c.mlp_activations[-1])(h1)
    h = constrain(h, ("activation_batch", "activation_exp", "activation_mlp"), c.logical_axis_rules)
    out = jnp.einsum("tnm,nme->tne", h, self.wo[...].astype(self.dtype), precision=self.precision)
    y = jnp.einsum("tne,tn->te", out.astype(jnp.float32), combine).astype(self.dtype)
    return checkpoint_name(y.reshape(b, s, e), "mlpwo"), aux
