"""Gated MLP: wo(act0(x wi_0) * act1(x wi_1)); one activation -> wo(act0(x wi))."""

from __future__ import annotations

from collections.abc import Callable

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
  "sigmoid": jax.nn.sigmoid,
  "linear": lambda x: x,
}
CLAMPED_GLU_ALPHA = 1.702  # gpt-oss's sigmoid gain (HF swiglu_alpha; MaxText uses the same constant)


def activation(name: str):
  return ACTIVATIONS[name]


def glu_limit(config: MaxTextConfig) -> float:
  """The clamp of the experts' gated activation: mlp_activations_limit for families with gpt-oss's clamped SwiGLU, else 0."""
  from maxtext.models import registry  # layers import no model code at module level

  return float(config.mlp_activations_limit) if registry.get(config.decoder_block).clamped_glu else 0.0


def glu(activations: tuple[str, ...], limit: float = 0.0) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The experts' gate: (h0, h1) = (x wi_0, x wi_1) -> the hidden activation before wo.

  act0(h0) * act1(h1); with gpt-oss's clamped SwiGLU (limit L > 0, glu_limit): g = min(h0, L), u = clip(h1, -L, L),
  (u + 1) * g * act0(1.702 g), as Hugging Face's GptOssExperts computes it.
  """
  act0, act1 = activation(activations[0]), activation(activations[-1])
  if limit <= 0:
    return lambda h0, h1: act0(h0) * act1(h1)

  def clamped(h0: jax.Array, h1: jax.Array) -> jax.Array:
    g = jnp.minimum(h0, jnp.asarray(limit, h0.dtype))
    u = jnp.clip(h1, -limit, limit)
    return (u + 1) * g * act0(CLAMPED_GLU_ALPHA * g)

  return clamped


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
