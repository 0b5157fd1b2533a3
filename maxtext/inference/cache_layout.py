"""The whole model's KV cache: how layers group into scanned stacks, its shapes, shardings and size.

With scan_layers=true the per-layer windows repeat with some period p (1 for uniform models, 2 for
Gemma 2's local/global alternation). Decoding scans over groups of p consecutive layers; position j of a
group has its own stacked cache [num_groups, B, K, T_j, D], so each layer keeps a cache of its own length
(a ring of sliding_window_size slots for local layers). Layers after the last whole group (and every layer
with scan_layers=false) keep unstacked caches in `tail`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxtext import mesh as mesh_lib
from maxtext.config import MaxTextConfig
from maxtext.inference.kv_cache import CACHE_AXES
from maxtext.layers.dtypes import bits, dtype
from maxtext.models import registry

STACK_AXIS = "cache_layers"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeCache:
  """scan: per group position j, {'key', 'value'} [num_groups, B, K, T_j, D]; tail: per leftover layer [B, K, T, D];
  lengths [B]: tokens cached per row. A quantized cache adds {'key_scale', 'value_scale'} [..., B, K or 1, T, 1]."""

  scan: tuple[dict[str, jax.Array], ...]
  tail: tuple[dict[str, jax.Array], ...]
  lengths: jax.Array


@dataclasses.dataclass(frozen=True)
class Layout:
  windows: tuple[int, ...]  # sliding window per layer (0 = global)
  period: int  # layers per scanned group (0 when nothing is scanned)
  num_groups: int
  max_length: int  # slots of a global layer: max_target_length

  @property
  def tail_layers(self) -> range:
    return range(self.period * self.num_groups, len(self.windows))

  def slots(self, window: int) -> int:
    return min(window, self.max_length) if window else self.max_length


def _period(windows: list[int]) -> int:
  return next(p for p in range(1, len(windows) + 1) if all(w == windows[i % p] for i, w in enumerate(windows)))


def layout(config: MaxTextConfig, max_length: int | None = None) -> Layout:
  windows = registry.get(config.decoder_block).layer_windows(config)
  max_length = max_length or config.max_target_length
  if not config.scan_layers:
    return Layout(tuple(windows), 0, 0, max_length)
  p = _period(windows)
  return Layout(tuple(windows), p, len(windows) // p, max_length)


def _layer_shape(config: MaxTextConfig, lay: Layout, batch: int, window: int) -> tuple[int, ...]:
  return (batch, config.num_kv_heads, lay.slots(window), config.head_dim)


def kv_dtype(config: MaxTextConfig) -> jnp.dtype:
  """The cache's key/value dtype: kv_quant_dtype with quantize_kvcache, else the compute dtype."""
  return jnp.dtype(config.kv_quant_dtype if config.quantize_kvcache else config.dtype)


def abstract(config: MaxTextConfig, batch: int, lay: Layout) -> DecodeCache:
  """ShapeDtypeStructs of an empty cache (keys and values in config.dtype, or quantized with scales in config.dtype)."""
  dt, scale_dt = kv_dtype(config), dtype(config.dtype)
  per_head = config.kv_quant_axis == "dkv"

  def kv(shape):
    arrays = {"key": jax.ShapeDtypeStruct(shape, dt), "value": jax.ShapeDtypeStruct(shape, dt)}
    if config.quantize_kvcache:
      scale = (*shape[:-3], shape[-3] if per_head else 1, shape[-2], 1)
      arrays.update(key_scale=jax.ShapeDtypeStruct(scale, scale_dt), value_scale=jax.ShapeDtypeStruct(scale, scale_dt))
    return arrays

  scan = tuple(kv((lay.num_groups, *_layer_shape(config, lay, batch, lay.windows[j]))) for j in range(lay.period))
  tail = tuple(kv(_layer_shape(config, lay, batch, lay.windows[i])) for i in lay.tail_layers)
  return DecodeCache(scan, tail, jax.ShapeDtypeStruct((batch,), jnp.int32))


def logical_axes(cache: DecodeCache) -> DecodeCache:
  """Logical axis names of every cache array (MaxText's cache_* names; a stacked cache adds cache_layers). Scales
  are split like their keys, except on their axes of size 1."""

  def axes(name: str, x: Any) -> tuple[str | None, ...]:
    full = CACHE_AXES if x.ndim == len(CACHE_AXES) else (STACK_AXIS, *CACHE_AXES)
    return tuple(a if not name.endswith("_scale") or n > 1 else None for a, n in zip(full, x.shape))

  return DecodeCache(
    tuple({k: axes(k, x) for k, x in g.items()} for g in cache.scan),
    tuple({k: axes(k, x) for k, x in t.items()} for t in cache.tail),
    ("cache_batch",),
  )


def shardings(config: MaxTextConfig, mesh: Mesh, cache: DecodeCache) -> DecodeCache:
  """NamedShardings of the cache under the config's logical_axis_rules."""
  is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)  # noqa: E731
  return jax.tree.map(lambda axes: NamedSharding(mesh, mesh_lib.logical_to_spec(axes, config.logical_axis_rules, mesh)), logical_axes(cache), is_leaf=is_axes)


def zeros(config: MaxTextConfig, batch: int, lay: Layout) -> DecodeCache:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract(config, batch, lay))


def nbytes(cache: DecodeCache) -> tuple[int, int]:
  """(bytes of the keys and values, with their scales when quantized; bytes of the per-row lengths)."""
  kv = sum(int(np.prod(x.shape)) * bits(x.dtype) // 8 for g in (*cache.scan, *cache.tail) for x in g.values())
  return kv, int(np.prod(cache.lengths.shape)) * 4


def theoretical_bytes(config: MaxTextConfig, batch: int, lay: Layout) -> int:
  """2 (key, value) x batch x sum over layers of slots x (kv_heads x head_dim x bits per element + scales) / 8."""
  per_token = config.num_kv_heads * config.head_dim * bits(kv_dtype(config))
  if config.quantize_kvcache:
    per_token += (config.num_kv_heads if config.kv_quant_axis == "dkv" else 1) * bits(dtype(config.dtype))
  return 2 * batch * per_token * sum(lay.slots(w) for w in lay.windows) // 8
