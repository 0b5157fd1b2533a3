"""Rotary position embeddings (half-split or interleaved pairs, as Hugging Face), with llama3.1 and YaRN frequency scaling."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeSpec:
  """One attention kind's rotary embedding (maxtext.models.specs builds it from the rope_* keys)."""

  kind: str = "default"  # rope_type: default | llama3.1 | yarn
  theta: float = 10_000.0  # rope_max_timescale
  linear_scaling: float = 1.0  # rope_linear_scaling_factor: default and llama3.1 frequencies divided by it
  llama3_factor: float = 8.0  # rope_scaling_factor
  low_freq_factor: float = 1.0  # rope_low_freq_factor
  high_freq_factor: float = 4.0  # rope_high_freq_factor
  llama3_original_max_position: int = 8192  # rope_original_max_position_embeddings
  yarn_factor: float = 1.0  # rope_factor
  yarn_original_max_position: int = 4096  # original_max_position_embeddings
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True  # rope_truncate
  attention_scaling: bool = False  # rope_attention_scaling: yarn scales cos/sin by its mscale
  local_theta: float = 0.0  # local_rope_max_timescale: > 0, sliding-window layers rotate with this base, unscaled
  interleave: bool = False  # rotary pairs interleaved (x[2i], x[2i+1]) instead of split halves
  proportion: float = 1.0  # proportional rope (Gemma 4): only the first proportion x dim / 2 frequency pairs rotate, the rest keep frequency 0
  mrope_section: tuple[int, ...] = ()  # use_mrope (Qwen3-VL): (t, h, w) frequency counts; 3-D positions rotate pair i by the axis mrope_axes gives


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
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    with np.errstate(divide="ignore", invalid="ignore"):  # equal factors (Llama 4 Scout: 1, 1) leave no middle band to smooth
      smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
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


def layer_frequencies(spec: RopeSpec, dim: int, local: bool = False) -> tuple[np.ndarray, float]:
  """(inverse frequencies [dim // 2], cos/sin scale) of one layer (_frequencies), the pairs past spec.proportion of
  them at frequency 0 (unrotated), as Hugging Face's proportional rope."""
  inv, scale = _frequencies(spec, dim, local)
  if spec.proportion < 1.0:
    inv = np.where(np.arange(inv.shape[0]) < int(spec.proportion * dim // 2), inv, 0.0)
  return inv, scale


def _frequencies(spec: RopeSpec, dim: int, local: bool = False) -> tuple[np.ndarray, float]:
  """(inverse frequencies [dim // 2], cos/sin scale) of one layer's rotary embedding over `dim` dimensions.

  local: a sliding-window layer; with local_theta set it rotates with that base and no scaling (gemma3).
  Otherwise the kind decides: llama3.1 or yarn frequency scaling (yarn also scales cos/sin with
  attention_scaling), or the default frequencies divided by linear_scaling.
  """
  s = spec
  if local and s.local_theta > 0:
    return inverse_frequencies(dim, s.local_theta), 1.0
  if s.kind == "yarn":
    inv = yarn_inverse_frequencies(dim, s.theta, s.yarn_factor, s.yarn_original_max_position, s.beta_fast, s.beta_slow, s.truncate)
    return inv, yarn_mscale(s.yarn_factor) if s.attention_scaling else 1.0
  inv = inverse_frequencies(dim, s.theta, s.kind, s.llama3_factor, s.low_freq_factor, s.high_freq_factor, s.llama3_original_max_position)
  return inv / s.linear_scaling, 1.0


def mrope_axes(section: tuple[int, ...], pairs: int) -> np.ndarray:
  """Qwen3-VL's interleaved multimodal rope: the position axis (0 temporal, 1 height, 2 width) of each of `pairs`
  frequency pairs. Pair i takes height when i % 3 == 1 and i < 3 section[1], width when i % 3 == 2 and i < 3 section[2],
  else temporal (HF apply_interleaved_mrope)."""
  i = np.arange(pairs)
  axes = np.zeros(pairs, np.int32)
  for axis in (1, 2):
    axes[(i % 3 == axis) & (i < 3 * section[axis])] = axis
  return axes


def apply_rope(
  x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array, interleave: bool = False, scale: float = 1.0, mrope_section: tuple[int, ...] = ()
) -> jax.Array:
  """x [B, S, heads, head_dim], positions [B, S] (or [B, S, 3] temporal/height/width positions with mrope_section:
  pair i rotates by the position of axis mrope_axes(i)) -> rotated x (computed in float32).

  Pairs are (x[i], x[i + D/2]), or with interleave (x[2i], x[2i+1]); the interleaved result comes back
  in half-split order (as Hugging Face DeepSeek does), which leaves every query-key dot product unchanged.
  cos and sin are multiplied by scale (YaRN's attention scaling).
  """
  if positions.ndim == 3:
    if not mrope_section:
      raise ValueError("3-D (multimodal rope) positions need an mrope_section")
    per_pair = positions[:, :, mrope_axes(mrope_section, x.shape[-1] // 2)]  # [B, S, D/2]
    angles = per_pair.astype(jnp.float32)[:, :, None, :] * jnp.asarray(inv_freq, jnp.float32)
  else:
    angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq, jnp.float32)  # [B,S,1,D/2]
  sin, cos = jnp.sin(angles) * scale, jnp.cos(angles) * scale
  x32 = x.astype(jnp.float32)
  x1, x2 = (x32[..., 0::2], x32[..., 1::2]) if interleave else jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
