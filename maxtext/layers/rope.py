"""Rotary position embeddings (half-split layout, as Hugging Face), with llama3.1 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """x [B, S, heads, head_dim], positions [B, S] -> rotated x (computed in float32)."""
  angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq, jnp.float32)  # [B,S,1,D/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
