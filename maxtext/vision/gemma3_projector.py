"""Gemma 3's multimodal projector: the SigLIP patch grid pooled to mm_tokens_per_image soft tokens in the text's width.

With G = patches per side, T = sqrt(mm_tokens_per_image) tokens per side and k = G / T:

    grid   = features as [B, G, G, E_v] (row-major patches)
    pooled = mean over each k x k block                  [B, T, T, E_v] -> [B, T^2, E_v]
    tokens = RMSNorm_zc(pooled) . W                      [B, T^2, E_text]   (Gemma's norm: x / rms(x) * (1 + s))
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.sharding import Rules, constrain
from maxtext.platform import Policy


@dataclasses.dataclass(frozen=True)
class Gemma3ProjectorSpec:
  """The numbers the projector reads (Hugging Face Gemma3Config's names in comments)."""

  patches_per_side: int  # vision_config.image_size // vision_config.patch_size
  vision_dim: int  # vision_config.hidden_size
  text_dim: int  # text_config.hidden_size
  mm_tokens_per_image: int  # mm_tokens_per_image: a square number whose side divides patches_per_side
  norm_eps: float = 1e-6  # vision_config.layer_norm_eps
  rules: Rules = ()  # logical_axis_rules

  def __post_init__(self):
    side = math.isqrt(self.mm_tokens_per_image)
    if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
      raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side divides the {self.patches_per_side} patches per side")

  @property
  def tokens_per_side(self) -> int:
    return math.isqrt(self.mm_tokens_per_image)

  @property
  def pool(self) -> int:
    """The side of the averaged blocks of patches."""
    return self.patches_per_side // self.tokens_per_side


def average_pool(features: jax.Array, patches_per_side: int, pool: int) -> jax.Array:
  """[B, G*G, E] row-major patches -> [B, (G/k)^2, E]: the mean of each k x k block, in float32."""
  b, _, e = features.shape
  t = patches_per_side // pool
  grid = features.astype(jnp.float32).reshape(b, t, pool, t, pool, e)
  return jnp.mean(grid, axis=(2, 4)).reshape(b, t * t, e)


class Gemma3Projector(nnx.Module):
  """projector(patch features [B, G^2, E_v]) -> image soft tokens [B, mm_tokens_per_image, E_text]."""

  def __init__(self, spec: Gemma3ProjectorSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.norm = RMSNorm(spec.vision_dim, spec.norm_eps, dtype=policy.dtypes.compute, weight_dtype=policy.dtypes.params, zero_centered=True)
    self.projection = DenseGeneral((spec.vision_dim,), (spec.text_dim,), (None, "embed"), **dict(dense_kwargs(policy, rngs), quant=None))

  def __call__(self, features: jax.Array) -> jax.Array:
    spec = self.spec
    pooled = average_pool(features, spec.patches_per_side, spec.pool).astype(features.dtype)
    tokens = self.projection(self.norm(pooled))
    return constrain(tokens, ("activation_batch", "activation_length", "activation_embed"), spec.rules)
