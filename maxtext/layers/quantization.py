"""Quantized matmuls with qwix: the recipe `quantization` names, and the products the dense layers and experts make with it.

For a product y = x . W (x: activations, contracting axes K; W: a kernel), symmetric quantization with scales
computed from the operands (current scaling):

    s_x = calib(x) / q_max over K, one scale per token;  s_W = calib(W) / q_max over K, one per output channel
    y  ~= (round(x / s_x) . round(W / s_W)) * s_x * s_W       (int8: an int8 x int8 -> int32 dot)

calib is absmax (the largest |value|), or with fp8_full the calibration keys: `absmax,c` (c x absmax), `rms,c`
(c x root mean square) or `fixed,lo,hi` (a static range). q_max is 127.5 for int8 and 448 for e4m3 (qwix).

Training (quantization-aware, `qwix` dot_general_qt): the forward product is quantized; the backward pass is
straight-through. int8 computes both gradient products dx = g . W^T and dW = x^T . g from the unquantized operands
in the compute dtype; fp8 and fp8_full quantize the incoming gradient g to e5m2 (per channel; the weight
gradient's token axis in `grad_tiles` tiles) against the forward pass's quantized operands.

Stored kernels (`Recipe.stored`: the frozen base of LoRA, decoding): W is kept as its quantized values and scales
(int8 or e4m3 per output channel; int4 also per group of INT4_GROUP inputs, two values per byte); the forward product is qwix's
dot_general on them (int8 x int8 -> int32 when activations are quantized too, else W dequantized into the compute
dtype) and the only gradient, dx = g . dequantize(W)^T, is taken in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from qwix._src.core import dot_general_qt

from maxtext.errors import ConfigError
from maxtext.quantization_recipe import FORMATS, QTYPES, Recipe, check_devices, recipe  # noqa: F401  (the recipe sits below the platform policy)

INT4_GROUP = 128  # int4 weight scales: one per this many values of the last contracting axis (QLoRA-style groups), when it is a multiple
SCALE_DTYPE = jnp.float32  # stored scales (a few bytes per output channel or group)


def qtype(name: str) -> Any:
  return getattr(jnp, QTYPES[name])


# --------------------------------------------------------------------------------------------------------------------
# Quantization-aware products on float operands (training)


def _qt_config(r: Recipe) -> dot_general_qt.DotGeneralQtConfig:
  grad = qtype(r.gradient) if r.gradient else None
  return dot_general_qt.DotGeneralQtConfig(
    lhs_qtype=qtype(r.activation),
    rhs_qtype=qtype(r.weight),
    lhs_calibration_method=r.act_calibration,
    rhs_calibration_method=r.weight_calibration,
    dlhs_grad_qtype=grad,
    dlhs_grad_calibration_method=r.grad_calibration,
    drhs_grad_qtype=grad,
    drhs_grad_calibration_method=r.grad_calibration,
    drhs_tile_size=(1.0 / r.grad_tiles) if grad is not None and r.grad_tiles > 1 else None,
    use_original_residuals=grad is None,  # int8: gradient products from the unquantized operands (straight-through)
  )


def einsum_dims(spec: str) -> tuple[Any, tuple[int, ...]]:
  """An explicit two-operand einsum spec (no '...') -> (dot_general dimension numbers, permutation of its output to spec's)."""
  inputs, out = spec.split("->")
  lhs, rhs = inputs.split(",")
  batch = [a for a in lhs if a in rhs and a in out]
  contract = [a for a in lhs if a in rhs and a not in out]
  dims = (
    (tuple(lhs.index(a) for a in contract), tuple(rhs.index(a) for a in contract)),
    (tuple(lhs.index(a) for a in batch), tuple(rhs.index(a) for a in batch)),
  )
  natural = batch + [a for a in lhs if a not in rhs] + [a for a in rhs if a not in lhs]
  return dims, tuple(natural.index(a) for a in out)


def _in_order(y: jax.Array, perm: tuple[int, ...]) -> jax.Array:
  return y if perm == tuple(range(len(perm))) else jnp.transpose(y, perm)


def _varying(a: jax.Array) -> frozenset[str]:
  """The manual mesh axes an array inside shard_map varies over (empty outside)."""
  return jax.typeof(a).manual_axis_type.varying


def varying_alike(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """Inside shard_map: every array made varying over the mesh axes any of them varies over, so a custom VJP's
  cotangents (a weight gradient summed over sharded tokens) have their inputs' types; the cast's transpose sums them
  over those axes. Outside shard_map, the arrays unchanged."""
  axes = frozenset().union(*map(_varying, arrays))
  return tuple(jax.lax.pcast(a, tuple(sorted(axes - _varying(a))), to="varying") if axes - _varying(a) else a for a in arrays)


def einsum(spec: str, x: jax.Array, kernel: jax.Array, r: Recipe, dtype: Any) -> jax.Array:
  """einsum(spec, x, kernel) (x: activations, kernel: float weights; explicit letters) quantized per r, operands cast
  to dtype first; result in dtype."""
  if r.activation is None:
    raise ValueError(f"quantization={r.mode} is weight-only: its kernels must be stored quantized")
  dims, perm = einsum_dims(spec)
  x, kernel = varying_alike(x.astype(dtype), kernel.astype(dtype))
  out = dot_general_qt.dot_general_qt(x, kernel, dims, _qt_config(r))
  return _in_order(out.astype(dtype), perm)


def trailing_spec(x_ndim: int, n_in: int, n_out: int) -> str:
  """The einsum spec contracting x's last n_in axes with a kernel [*in, *out]: e.g. 'abc,cd->abd'."""
  letters = "abcdefghijklmnopqrstuvwxyz"
  lead, contracted, produced = letters[: x_ndim - n_in], letters[x_ndim - n_in : x_ndim], letters[x_ndim : x_ndim + n_out]
  return f"{lead}{contracted},{contracted}{produced}->{lead}{produced}"


_RAGGED_DLHS = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_RAGGED_DRHS = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _per_row(group_scale: jax.Array, group_sizes: jax.Array, rows: int) -> jax.Array:
  """Per-group scales [G, 1, N] -> each row's own group's [rows, N] (rows past the groups take the last group's)."""
  return jnp.repeat(group_scale[:, 0, :], group_sizes, axis=0, total_repeat_length=rows)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, r: Recipe, dtype: Any) -> jax.Array:
  """Grouped matmul [M, K] x [G, K, N] (rows grouped by group_sizes) with int8/fp8 operands, result in dtype.

  Forward: lhs quantized per row, rhs per group (expert) and column, each by the recipe's calibration, from float32
  (no double rounding); qwix's ragged_dot multiplies each row's int32 / float32 accumulator by its row's and its
  group's scales. (qwix's ragged_dot_qt shares one scale per column among all groups and calibrates by absmax only.)

  Backward, as the dense products (`einsum`): int8 straight-through, dx = g . W^T and dW_e = x_e^T . g_e from the
  unquantized operands in dtype with float32 accumulation; fp8 quantizes the incoming gradient to e5m2 by the
  gradient calibration against the forward's quantized operands: dx from g scaled by each row's group's weight
  scales, quantized per row; dW from g scaled by the row scales, quantized per column.
  """
  grad = qtype(r.gradient) if r.gradient else None

  def quantized(x, w):
    qx = qwix.quantize(x.astype(jnp.float32), qtype(r.activation), channelwise_axes=[0], calibration_method=r.act_calibration)
    qw = qwix.quantize(w.astype(jnp.float32), qtype(r.weight), channelwise_axes=[0, 2], calibration_method=r.weight_calibration)
    return qx, qw

  def forward(x, w, group_sizes):
    qx, qw = quantized(x, w)
    return qwix.ragged_dot(qx, qw, group_sizes).astype(dtype), (qx, qw) if grad is not None else (x, w)

  def backward(residuals, g):
    (a, w), group_sizes = residuals
    rows = g.shape[0]
    if grad is None:  # a, w: the unquantized operands (in dtype)
      g = g.astype(dtype)
      dx = jax.lax.ragged_dot_general(g, w, group_sizes, _RAGGED_DLHS, preferred_element_type=jnp.float32)
      dw = jax.lax.ragged_dot_general(a, g, group_sizes, _RAGGED_DRHS, preferred_element_type=jnp.float32)
    else:  # a, w: the forward's QArrays
      g = g.astype(jnp.float32)
      gx = qwix.quantize(g * _per_row(w.scale, group_sizes, rows), grad, channelwise_axes=[0], calibration_method=r.grad_calibration)
      dx = jax.lax.ragged_dot_general(gx.qvalue, w.qvalue, group_sizes, _RAGGED_DLHS, preferred_element_type=jnp.float32) * gx.scale
      gw = qwix.quantize(g * a.scale, grad, channelwise_axes=[1], calibration_method=r.grad_calibration)
      dw = jax.lax.ragged_dot_general(a.qvalue, gw.qvalue, group_sizes, _RAGGED_DRHS, preferred_element_type=jnp.float32) * gw.scale
    return dx.astype(x_dtype), dw.astype(w_dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)

  def fwd(x, w, group_sizes):
    out, residuals = forward(x, w, group_sizes)
    return out, (residuals, group_sizes)

  lhs, rhs = varying_alike(lhs.astype(dtype), rhs.astype(dtype))
  x_dtype, w_dtype = lhs.dtype, rhs.dtype
  fn = jax.custom_vjp(lambda x, w, group_sizes: forward(x, w, group_sizes)[0])
  fn.defvjp(fwd, backward)
  return fn(lhs, rhs, group_sizes)


# --------------------------------------------------------------------------------------------------------------------
# Stored (quantized) kernels


class KernelScale(nnx.Param):
  """Scales of a stored quantized kernel, named after it: `<kernel>_scale` (metadata in_axes, out_axes: the kernel's
  contracting and output axes; leading axes beyond them, stacked layers or experts, get scales of their own)."""


SCALE_SUFFIX = "_scale"


def kernel_path(scale_path: tuple) -> tuple:
  """The path of the kernel a KernelScale at scale_path belongs to ('.../kernel_scale' -> '.../kernel')."""
  return (*scale_path[:-1], str(scale_path[-1]).removesuffix(SCALE_SUFFIX))


def scale_shape(shape: Sequence[int], n_in: int, weight: str) -> tuple[int, ...]:
  """Shape of a stored kernel's scales: one per output channel (1 on the contracting axes); int4 also per index of
  the leading contracting axes (e.g. per head) and per group of INT4_GROUP along the last one."""
  shape = tuple(shape)
  scale = [1] * n_in + list(shape[n_in:])
  if weight == "int4":
    scale[: n_in - 1] = shape[: n_in - 1]
    last = shape[n_in - 1]
    scale[n_in - 1] = last // INT4_GROUP if last > INT4_GROUP and last % INT4_GROUP == 0 else 1
  return tuple(scale)


def scale_axes(axes: Sequence[str | None], shape: Sequence[int], n_in: int, weight: str) -> tuple[str | None, ...]:
  """Logical axes of the scales: the kernel's, except on axes of size 1 (replicated)."""
  return tuple(a if s > 1 else None for a, s in zip(axes, scale_shape(shape, n_in, weight)))


def quantize_kernel(kernel: jax.Array, n_in: int, r: Recipe, batch_axes: int = 0) -> tuple[jax.Array, jax.Array]:
  """A float kernel [*batch, *in, *out] -> (values in r.weight, float32 scales): symmetric absmax (or the fp8_full
  weight calibration) over the contracting axes, per output channel (int4: per group of INT4_GROUP inputs)."""
  w = jnp.asarray(kernel, jnp.float32)
  lead = tuple(range(batch_axes))
  inner = w.shape[batch_axes:]
  target = scale_shape(inner, n_in, r.weight)
  tiled = {batch_axes + i: inner[i] // target[i] for i in range(n_in) if target[i] > 1}  # int4: per head / per group
  channels = [*lead, *range(batch_axes + n_in, w.ndim)]
  q = qwix.quantize(w, qtype(r.weight), channelwise_axes=channels, tiled_axes=tiled, calibration_method=r.weight_calibration)
  values = pack_int4(q.qvalue, batch_axes + n_in - 1) if r.weight == "int4" else q.qvalue
  return values, q.scale.astype(SCALE_DTYPE)


def pack_int4(values: jax.Array, axis: int) -> jax.Array:
  """int4 values -> uint8, two per byte along axis (even index in the low nibble). Stored so on every platform: XLA's
  own int4 arrays are unpacked on CPU, and their layouts disagree between executables there."""
  if values.shape[axis] % 2:
    raise ConfigError(f"int4 kernels hold two values per byte along the contracting axis, whose size {values.shape[axis]} is odd; use int8")
  v = jnp.moveaxis(values.astype(jnp.int8).astype(jnp.uint8) & 0xF, axis, -1)
  packed = v[..., 0::2] | (v[..., 1::2] << 4)
  return jnp.moveaxis(packed, -1, axis)


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
  """pack_int4's inverse: uint8 -> int8 values in [-8, 7], twice as long along axis."""
  p = jnp.moveaxis(packed, axis, -1)
  low = (p << 4).astype(jnp.int8) >> 4  # arithmetic shifts sign-extend the nibbles
  high = p.astype(jnp.int8) >> 4
  return jnp.moveaxis(jnp.stack([low, high], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1]), -1, axis)


def unpacked_shape(shape: Sequence[int], scale_variable: nnx.Variable, weight: str) -> tuple[int, ...]:
  """The float kernel's shape of a stored kernel of `shape` (int4 packs its last contracting axis two per byte)."""
  shape = list(shape)
  if weight == "int4":
    shape[len(shape) - scale_variable.get_metadata()["out_axes"] - 1] *= 2
  return tuple(shape)


def stored_qarray(values: jax.Array, scale: jax.Array, packed_axis: int, r: Recipe) -> qwix.QArray:
  """A stored kernel as qwix's QArray (int4 unpacked into int8 containers), scales in float32: qwix multiplies the
  product's accumulator by the scales in their dtype, so float32 scales keep the int32 (or float32) accumulator
  unrounded until the one cast to the compute dtype, as the float product does."""
  values = unpack_int4(values, packed_axis) if r.weight == "int4" else values
  return qwix.QArray(values, scale.astype(jnp.float32), qtype=qtype(r.weight))


def quantize_like(kernel: jax.Array, scale_variable: nnx.Variable, r: Recipe) -> tuple[jax.Array, jax.Array]:
  """A float kernel -> (values, scales) laid out as the KernelScale variable of a stored kernel says (leading stacked axes included)."""
  meta = scale_variable.get_metadata()
  n_in, n_out = meta["in_axes"], meta["out_axes"]
  return quantize_kernel(kernel, n_in, r, batch_axes=kernel.ndim - n_in - n_out)


def _frozen_kernel_product(x: jax.Array, values: jax.Array, scale: jax.Array, forward: Any, input_grad: Any, *aux: jax.Array) -> jax.Array:
  """forward(x, values, scale, *aux), differentiable in x only: dx = input_grad(g, values, scale, *aux). A stored kernel
  is frozen (no optimizer updates it); its values and the integer aux arrays (group sizes) take no gradient."""
  x_dtype = x.dtype

  def no_gradient(a: jax.Array) -> jax.Array:
    return jnp.zeros_like(a) if jnp.issubdtype(a.dtype, jnp.inexact) else np.zeros(a.shape, jax.dtypes.float0)

  def backward(residuals, g):
    return (input_grad(g, *residuals).astype(x_dtype), *(no_gradient(a) for a in residuals))

  fn = jax.custom_vjp(forward)
  fn.defvjp(lambda x, *rest: (forward(x, *rest), rest), backward)
  return fn(x, values, scale, *aux)


def _activations(x: jax.Array, contracting: Sequence[int], r: Recipe, dtype: Any) -> jax.Array | qwix.QArray:
  """x in dtype, quantized per token (every axis but the contracting ones) when the recipe quantizes activations.

  The quotient x / s is taken in float32: qwix divides in the array's dtype, and a bfloat16 quotient (8 significant
  bits: steps of 0.5 above 64) would be rounded once before the rounding to int8 (double rounding)."""
  x = x.astype(dtype)
  if r.activation is None:
    return x
  free = [i for i in range(x.ndim) if i not in contracting]
  return qwix.quantize(x.astype(jnp.float32), qtype(r.activation), channelwise_axes=free, calibration_method=r.act_calibration)


def stored_einsum(spec: str, x: jax.Array, values: jax.Array, scale: jax.Array, r: Recipe, dtype: Any) -> jax.Array:
  """einsum(spec, x, W) for a stored kernel W = (values, scale), result in dtype; differentiable in x only.

  Forward: qwix.dot_general on x quantized per token (r.activation; weight-only recipes keep x in dtype) and the
  stored QArray. Backward: dx = g . dequantize(W), operands in dtype with float32 accumulation.
  """
  from maxtext.layers import matmul

  dims, perm = einsum_dims(spec)
  inputs, out = spec.split("->")
  lhs, rhs = inputs.split(",")
  packed_axis = max(rhs.index(a) for a in rhs if a in lhs and a not in out)  # int4: the last contracting axis

  def forward(x, values, scale):
    w = stored_qarray(values, scale, packed_axis, r)
    return _in_order(qwix.dot_general(_activations(x, dims[0][0], r, dtype), w, dims).astype(dtype), perm)

  def input_grad(g, values, scale):
    w = qwix.dequantize(stored_qarray(values, scale, packed_axis, r)).astype(dtype)
    return matmul.product(f"{out},{rhs}->{lhs}", g.astype(dtype), w)

  return _frozen_kernel_product(*varying_alike(x, values, scale), forward, input_grad)


def stored_ragged_dot(x: jax.Array, values: jax.Array, scale: jax.Array, group_sizes: jax.Array, r: Recipe, dtype: Any) -> jax.Array:
  """Grouped matmul [M, K] x W [G, K, N] for stored experts W = (values, scale [G, 1, N]), differentiable in x only:
  qwix's ragged_dot on x quantized per row (weight-only: x in dtype); dx against the dequantized W."""

  def forward(x, values, scale, group_sizes):
    return qwix.ragged_dot(_activations(x, (1,), r, dtype), stored_qarray(values, scale, 1, r), group_sizes).astype(dtype)

  def input_grad(g, values, scale, group_sizes):
    w = qwix.dequantize(stored_qarray(values, scale, 1, r)).astype(dtype)
    return jax.lax.ragged_dot_general(g.astype(dtype), w, group_sizes, _RAGGED_DLHS, preferred_element_type=jnp.float32)

  return _frozen_kernel_product(*varying_alike(x, values, scale), forward, input_grad, group_sizes)


# --------------------------------------------------------------------------------------------------------------------
# MoE experts: the one place where the dispatch paths' expert weights and products meet quantization


def expert_weight(w: jax.Array, axes: tuple[str, ...], r: Recipe | None) -> tuple[nnx.Param, KernelScale | None]:
  """An expert weight [experts, in, out] as a parameter; with a stored recipe, its quantized values and the
  KernelScale to keep beside it as `<name>_scale` (per expert and output column; int4 also per input group)."""
  if r is None or not r.stored:
    return nnx.Param(w, logical_axes=axes), None
  values, scale = quantize_kernel(w, 1, r, batch_axes=1)
  scale_axes_ = (axes[0], *scale_axes(axes[1:], w.shape[1:], 1, r.weight))
  return nnx.Param(values, logical_axes=axes), KernelScale(scale, logical_axes=scale_axes_, in_axes=1, out_axes=1)


def expert_product(
  lhs: jax.Array, w: jax.Array, scale: jax.Array | None, r: Recipe, dtype: Any, group_sizes: jax.Array | None = None, spec: str | None = None
) -> jax.Array:
  """An expert projection under recipe r, in dtype: grouped (rows sorted by expert [M, in], group_sizes [experts]) or
  batched (the einsum spec, e.g. "ecd,edf->ecf" over [experts, slots, in]) against w [experts, in, out], stored (scale
  given) or quantized at each step."""
  if group_sizes is not None:
    return stored_ragged_dot(lhs, w, scale, group_sizes, r, dtype) if scale is not None else ragged_dot(lhs, w, group_sizes, r, dtype)
  if scale is not None:
    return stored_einsum(spec, lhs, w, scale, r, dtype)
  return einsum(spec, lhs, w, r, dtype)
