"""Gated MLP: wo(act0(x wi_0) * act1(x wi_1)); one activation -> wo(act0(x wi))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.config import MaxTextConfig
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.sharding import constrain
from maxtext.platform import Policy

ACTIVATIONS = {
  "silu": jax.nn.silu,
  "gelu": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
  "relu": jax.nn.relu,
  "linear": lambda x: x,
}


def activation(name: str):
  return ACTIVATIONS[name]


class MLP(nnx.Module):
  def __init__(self, config: MaxTextConfig, *, policy: Policy, rngs: nnx.Rngs, width: int | None = None):
    c = config
    self.config = c
    m = c.mlp_dim if width is None else width
    kw = dense_kwargs(c, policy, rngs)
    self.acts = tuple(c.mlp_activations)
    if len(self.acts) == 2:
      self.wi_0 = DenseGeneral((c.emb_dim,), (m,), ("embed", "mlp"), **kw)
      self.wi_1 = DenseGeneral((c.emb_dim,), (m,), ("embed", "mlp"), **kw)
      self.wi = None
    else:
      self.wi = DenseGeneral((c.emb_dim,), (m,), ("embed", "mlp"), **kw)
      self.wi_0 = self.wi_1 = None
    self.wo = DenseGeneral((m,), (c.emb_dim,), ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    rules = self.config.logical_axis_rules
    if self.wi is not None:
      h = activation(self.acts[0])(checkpoint_name(self.wi(x), "mlpwi"))
    else:
      h0 = checkpoint_name(self.wi_0(x), "mlpwi_0")
      h1 = checkpoint_name(self.wi_1(x), "mlpwi_1")
      h = activation(self.acts[0])(h0) * activation(self.acts[1])(h1)
    h = constrain(h.astype(jnp.dtype(h.dtype)), ("activation_batch", "activation_length", "activation_mlp"), rules)
    return checkpoint_name(self.wo(h), "mlpwo")
