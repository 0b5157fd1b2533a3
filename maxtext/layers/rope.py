"""Rotary position embeddings (half-split or interleaved pairs, as Hugging Face), with llama3.1 and YaRN frequency scaling."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from maxtext.config import MaxTextConfig


def inverse_frequencies(
  head_dim: int,
  theta: float,
  rope_type: str = "default",
  factor: float = 8.0,
  low_freq_factor: float = 1.0,
  high_freq_factor: float = 4.0,
  original_max_position: int = 8192,
) -> np.ndarray:
  """Per-pair inverse frequencies [head_dim // 2] (float64 numpy, a compile-time constant)."""
  inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if rope_type == "llama3.1":
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
  return inv


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature 0.1 mscale ln(factor) + 1 (1 when factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(
  dim: int, theta: float, factor: float, original_max_position: int, beta_fast: float, beta_slow: float, truncate: bool
) -> np.ndarray:
  """YaRN (NTK-by-parts): high frequencies kept, low frequencies divided by factor, a linear ramp in between."""
  inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))

  def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times into the original context
    return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  keep = 1.0 - ramp  # 1: extrapolate (original frequency), 0: interpolate (frequency / factor)
  return inv / factor * (1.0 - keep) + inv * keep


def layer_frequencies(c: MaxTextConfig, dim: int, local: bool = False) -> tuple[np.ndarray, float]:
  """(inverse frequencies [dim // 2], cos/sin scale) of one layer's rotary embedding over `dim` dimensions.

  local: a sliding-window layer; with local_rope_max_timescale set it rotates with that base and no scaling
  (gemma3). Otherwise rope_type decides: llama3.1 or yarn frequency scaling (yarn also scales cos/sin with
  rope_attention_scaling), or the default frequencies divided by rope_linear_scaling_factor.
  """
  if local and c.local_rope_max_timescale > 0:
    return inverse_frequencies(dim, c.local_rope_max_timescale), 1.0
  if c.rope_type == "yarn":
    inv = yarn_inverse_frequencies(dim, c.rope_max_timescale, c.rope_factor, c.original_max_position_embeddings, c.beta_fast, c.beta_slow, c.rope_truncate)
    return inv, yarn_mscale(c.rope_factor) if c.rope_attention_scaling else 1.0
  inv = inverse_frequencies(
    dim, c.rope_max_timescale, c.rope_type, c.rope_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_max_position_embeddings
  )
  return inv / c.rope_linear_scaling_factor, 1.0


def interleaved(c: MaxTextConfig, mla: bool) -> bool:
  """Whether rotary pairs are interleaved: rope_interleave for MLA and yarn rope, split halves for every other rope."""
  return c.rope_interleave and (mla or c.rope_type == "yarn")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array, interleave: bool = False, scale: float = 1.0) -> jax.Array:
  """x [B, S, heads, head_dim], positions [B, S] -> rotated x (computed in float32).

  Pairs are (x[i], x[i + D/2]), or with interleave (x[2i], x[2i+1]); the interleaved result comes back
  in half-split order (as Hugging Face DeepSeek does), which leaves every query-key dot product unchanged.
  cos and sin are multiplied by scale (YaRN's attention scaling).
  """
  angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq, jnp.float32)  # [B,S,1,D/2]
  sin, cos = jnp.sin(angles) * scale, jnp.cos(angles) * scale
  x32 = x.astype(jnp.float32)
  x1, x2 = (x32[..., 0::2], x32[..., 1::2]) if interleave else jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
