"""LoRA adapters on the dense projections of each decoder layer: W x + (alpha / r) B A x.

`attach(layer, spec, dtypes, rngs)` gives every DenseGeneral inside a decoder layer whose module path
(relative to the layer, e.g. 'attention/query', 'mlp/wi_0', 'mlp/gate') matches LoRASpec.module_path (lora.lora_module_path)
(re.search) an adapter in its `lora` slot. Because it runs inside each layer's constructor, stacked
(scanned) layers get stacked adapters with a leading 'layers' axis like every other layer parameter.

Candidates are the attention projections (query, key, value, out), the dense MLP projections
(wi_0, wi_1 or wi, wo) and the MoE router (mlp/gate). Stacked MoE expert weights, the embedding and the
output head take no adapters. A [in..., r] starts Kaiming-uniform (bound 1/sqrt(fan_in), as PEFT) and
B [r, out...] at zero, so an adapted model equals its base at init.

Several adapters (lora.max_lora_adapters > 1): each adapted projection holds one A [slots, in..., R] and
B [slots, R, out...] (R = max_lora_rank); slot s uses its first rank_s columns. Every row of a batch names
its slot (`adapter_ids` [batch], handed to the model's call); each slot's product runs on the whole batch
and `where` keeps it only on its rows, so no gradient reaches a slot from another slot's rows, and with
one slot in use the result is the single-adapter computation bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.errors import ConfigError
from maxtext.layers import matmul
from maxtext.layers.linear import DenseGeneral
from maxtext.platform import Dtypes


@dataclasses.dataclass(frozen=True)
class LoRASpec:
  """The adapters of each decoder layer (maxtext.models.specs builds it from the lora.* keys when enable_lora)."""

  module_path: str  # lora_module_path: a regex over module paths relative to the layer
  alpha: float  # lora_alpha: the update is (alpha / r) B A x
  ranks: tuple[int, ...]  # each adapter slot's rank r (one slot: lora_rank)
  max_rank: int  # the rank of the stored matrices (max_lora_rank with several slots)
  default_path: bool = True  # module_path is the default, which leaves routed experts alone instead of failing on them


def _init_a(key: jax.Array, in_shape: tuple[int, ...], rank: int) -> jax.Array:
  """A [*in_shape, rank] ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) in float32 (B starts at zero)."""
  bound = 1.0 / math.sqrt(math.prod(in_shape))
  return jax.random.uniform(key, (*in_shape, rank), jnp.float32, -bound, bound)


def _low_rank_update(adapter: Any, x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """scale * (x . A) . B in the adapter's compute dtype and precision."""
  kw = dict(dtype=adapter.dtype, precision=adapter.precision, integer_rounding=adapter.integer_rounding)
  y = matmul.contract_trailing(matmul.contract_trailing(x, a, adapter.in_ndim, **kw), b, 1, **kw)
  return y * jnp.asarray(scale, y.dtype)


class LoRAParam(nnx.Param):
  """An adapter matrix (A or B): the only parameters a LoRA run trains (with mHC connectors, if on)."""


class LoRA(nnx.Module):
  """(alpha / r) B A x for a DenseGeneral with kernel in_shape + out_shape; A is [in..., r], B is [r, out...]."""

  def __init__(
    self,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    in_axes: tuple[str | None, ...],
    out_axes: tuple[str | None, ...],
    rank: int,
    alpha: float,
    *,
    dtype: jnp.dtype,
    weight_dtype: jnp.dtype,
    precision: jax.lax.Precision,
    key: jax.Array,
    integer_rounding: bool = False,
  ):
    self.in_ndim = len(in_shape)
    self.integer_rounding = integer_rounding
    self.scale = alpha / rank
    self.dtype = dtype
    self.precision = precision
    self.lora_a = LoRAParam(_init_a(key, in_shape, rank).astype(weight_dtype), logical_axes=(*in_axes, None))
    self.lora_b = LoRAParam(jnp.zeros((rank, *out_shape), weight_dtype), logical_axes=(None, *out_axes))

  def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> jax.Array:
    """The update for every row of x; adapter_ids is for MultiLoRA's signature (one adapter serves every row)."""
    del adapter_ids
    return _low_rank_update(self, x, self.lora_a[...], self.lora_b[...], self.scale)


class MultiLoRA(nnx.Module):
  """Adapter slots for one DenseGeneral: row i of the batch gets (alpha / r_s) B_s A_s x with s = adapter_ids[i].

  A is [slots, in..., R], B [slots, R, out...]; slot s masks A's columns from its rank r_s on. Slot 0 draws
  A from `key` exactly as the single-adapter LoRA does (slot s > 0 from fold_in(key, s)).
  """

  def __init__(
    self,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    in_axes: tuple[str | None, ...],
    out_axes: tuple[str | None, ...],
    ranks: tuple[int, ...],
    max_rank: int,
    alpha: float,
    *,
    dtype: jnp.dtype,
    weight_dtype: jnp.dtype,
    precision: jax.lax.Precision,
    key: jax.Array,
    integer_rounding: bool = False,
  ):
    self.in_ndim = len(in_shape)
    self.integer_rounding = integer_rounding
    self.ranks = tuple(ranks)
    self.max_rank = max_rank
    self.scales = tuple(alpha / r for r in ranks)
    self.dtype = dtype
    self.precision = precision
    keys = [key] + [jax.random.fold_in(key, s) for s in range(1, len(ranks))]
    a = jnp.stack([_init_a(k, in_shape, max_rank) for k in keys])
    self.lora_a = LoRAParam(a.astype(weight_dtype), logical_axes=(None, *in_axes, None))
    self.lora_b = LoRAParam(jnp.zeros((len(ranks), max_rank, *out_shape), weight_dtype), logical_axes=(None, None, *out_axes))

  def slot(self, x: jax.Array, s: int) -> jax.Array:
    """Slot s's update for every row of x (masked to its rank)."""
    a = self.lora_a[...][s]
    if self.ranks[s] < self.max_rank:
      a = a * (jnp.arange(self.max_rank) < self.ranks[s]).astype(a.dtype)
    return _low_rank_update(self, x, a, self.lora_b[...][s], self.scales[s])

  def __call__(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> jax.Array:
    """x [B, ...] -> each row's (or token's) slot update. adapter_ids [B] per row or [B, S] per token (x [B, S, ...]);
    None: slot 0 for every row; an id that names no slot (e.g. -1) leaves its row on the base model."""
    ids = adapter_ids
    y = self.slot(x, 0)
    if ids is None:
      return y
    rows = jnp.asarray(ids).reshape(*ids.shape, *(1,) * (y.ndim - ids.ndim))  # [B] per row or [B, S] per token
    y = jnp.where(rows == 0, y, jnp.zeros_like(y))  # a row whose id names no slot (e.g. -1) gets no adapter
    for s in range(1, len(self.ranks)):
      y = jnp.where(rows == s, self.slot(x, s), y)
    return y


def module_path(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def candidates(layer: nnx.Module) -> dict[str, DenseGeneral]:
  """Every DenseGeneral of a decoder layer, by module path relative to the layer."""
  return {module_path(path): m for path, m in nnx.iter_modules(layer) if isinstance(m, DenseGeneral)}


def _side_key(rngs: nnx.Rngs) -> jax.Array:
  """A key derived from the params stream's current state without advancing it.

  Adapters draw from it, so the base parameters of every layer get the same random keys with or without
  LoRA (also unscanned, where the layers share one stream).
  """
  stream = rngs.params
  return jax.random.fold_in(jax.random.fold_in(stream.key[...], stream.count[...]), 0x10A)


def _reject_routed_experts(layer: nnx.Module, spec: LoRASpec, pattern: re.Pattern) -> None:
  """Routed experts take no adapters: an explicitly set lora_module_path that matches their stacked weights is an error.

  The default path names dense projections; in a MoE layer its 'mlp/(wi_0|wi_1|wo)' also matches the routed
  experts' weights, which it leaves alone (attention, router and shared experts still get adapters).
  """
  from maxtext.layers.moe import MoE

  if spec.default_path:
    return
  path = spec.module_path
  for module_path_, m in nnx.iter_modules(layer):
    if isinstance(m, MoE):
      routed = [f"{module_path(module_path_)}/{w}" for w in ("wi_0", "wi_1", "wo")]
      hit = [p for p in routed if pattern.search(p)]
      if hit:
        raise ConfigError(
          f"lora.lora_module_path '{path}' matches routed expert weights ({', '.join(hit)}); LoRA on routed experts is not supported, narrow the path (shared experts: mlp/shared_experts/...)"
        )


def attach(layer: nnx.Module, spec: LoRASpec | None, dtypes: Dtypes, rngs: nnx.Rngs) -> None:
  """Give the layer's matching DenseGenerals adapters (no-op for spec None: lora.enable_lora off)."""
  if spec is None:
    return
  modules = candidates(layer)
  pattern = re.compile(spec.module_path)
  _reject_routed_experts(layer, spec, pattern)
  chosen = sorted(p for p in modules if pattern.search(p))
  if not chosen:
    raise ConfigError(f"lora.lora_module_path '{spec.module_path}' matches no module; available module paths: {', '.join(sorted(modules))}")
  base_key = _side_key(rngs)
  for i, path in enumerate(chosen):
    dense = modules[path]
    axes = tuple(dense.kernel.get_metadata().get("logical_axes") or (None,) * dense.kernel[...].ndim)
    n_in = len(dense.in_shape)
    common = dict(
      dtype=dense.dtype,
      weight_dtype=dtypes.params,
      precision=dense.precision,
      key=jax.random.fold_in(base_key, i),
      integer_rounding=dense.integer_rounding,
    )
    if len(spec.ranks) == 1:
      adapter = LoRA(dense.in_shape, dense.out_shape, axes[:n_in], axes[n_in:], spec.ranks[0], spec.alpha, **common)
    else:
      adapter = MultiLoRA(dense.in_shape, dense.out_shape, axes[:n_in], axes[n_in:], spec.ranks, spec.max_rank, spec.alpha, **common)
    dense.lora = nnx.data(adapter)


def merge(kernel: jax.Array, lora_a: jax.Array, lora_b: jax.Array, scale: float, lead: int = 0) -> jax.Array:
  """kernel + scale * A B (contracting the rank axis) in float32, cast back to the kernel's dtype.

  `lead` leading axes (a stacked layer axis) are shared by kernel [lead, in..., out...], A [lead, in..., r]
  and B [lead, r, out...].
  """
  a = jnp.asarray(lora_a, jnp.float32)
  b = jnp.asarray(lora_b, jnp.float32)
  batch = tuple(range(lead))
  delta = jax.lax.dot_general(a, b, (((a.ndim - 1,), (lead,)), (batch, batch)), precision=jax.lax.Precision.HIGHEST)
  return (jnp.asarray(kernel, jnp.float32) + scale * delta).astype(jnp.asarray(kernel).dtype)
