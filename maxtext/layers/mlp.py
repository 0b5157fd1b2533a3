"""Gated MLP: wo(act0(x wi_0) * act1(x wi_1)); one activation -> wo(act0(x wi))."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.sharding import Rules, constrain
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


@dataclasses.dataclass(frozen=True)
class MLPSpec:
  """A dense gated MLP (maxtext.models.specs builds it)."""

  emb_dim: int
  width: int  # hidden width: mlp_dim (DeepSeek's shared experts: shared_experts x moe_mlp_dim)
  activations: tuple[str, ...]  # mlp_activations: two names gate wi_0 and wi_1, one name a single wi
  rules: Rules = ()  # logical_axis_rules
  glu_limit: float = 0.0  # > 0: the gate's inputs clamped (glu; DeepSeek V4's shared experts, with glu_clamp_only)
  glu_clamp_only: bool = False  # glu's DeepSeek V4 form: act0(min(h0, L)) * act1(clip(h1, -L, L))


def glu(activations: tuple[str, ...], limit: float = 0.0, clamp_only: bool = False) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The experts' gate: (h0, h1) = (x wi_0, x wi_1) -> the hidden activation before wo.

  act0(h0) * act1(h1); with a clamped SwiGLU (limit L > 0, MoESpec.glu_limit) g = min(h0, L), u = clip(h1, -L, L), then
  gpt-oss's (u + 1) * g * act0(1.702 g), as Hugging Face's GptOssExperts computes it, or with clamp_only DeepSeek V4's
  act0(g) * act1(u) (its swiglu_limit).
  """
  act0, act1 = activation(activations[0]), activation(activations[-1])
  if limit <= 0:
    return lambda h0, h1: act0(h0) * act1(h1)

  def clamped(h0: jax.Array, h1: jax.Array) -> jax.Array:
    g = jnp.minimum(h0, jnp.asarray(limit, h0.dtype))
    u = jnp.clip(h1, -limit, limit)
    if clamp_only:
      return act0(g) * act1(u)
    return (u + 1) * g * act0(CLAMPED_GLU_ALPHA * g)

  return clamped


class MLP(nnx.Module):
  def __init__(self, spec: MLPSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    e, m = spec.emb_dim, spec.width
    kw = dense_kwargs(policy, rngs)
    self.acts = spec.activations
    if len(self.acts) == 2:
      self.wi_0 = DenseGeneral((e,), (m,), ("embed", "mlp"), **kw)
      self.wi_1 = DenseGeneral((e,), (m,), ("embed", "mlp"), **kw)
      self.wi = None
    else:
      self.wi = DenseGeneral((e,), (m,), ("embed", "mlp"), **kw)
      self.wi_0 = self.wi_1 = None
    self.wo = DenseGeneral((m,), (e,), ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> jax.Array:
    """x [B, S, E] -> [B, S, E]; adapter_ids: each row's (or token's) LoRA slot, for adapted projections."""
    rules = self.spec.rules
    if self.wi is not None:
      h = activation(self.acts[0])(checkpoint_name(self.wi(x, adapter_ids), "mlpwi"))
    else:
      h0 = checkpoint_name(self.wi_0(x, adapter_ids), "mlpwi_0")
      h1 = checkpoint_name(self.wi_1(x, adapter_ids), "mlpwi_1")
      h = glu(self.acts, self.spec.glu_limit, self.spec.glu_clamp_only)(h0, h1)
    h = constrain(h.astype(jnp.dtype(h.dtype)), ("activation_batch", "activation_length", "activation_mlp"), rules)
    return checkpoint_name(self.wo(h, adapter_ids), "mlpwo")
