"""The output head: final hidden states -> float32 logits, and a fused logits + cross entropy.

The logits matmul runs as MaxText's does: by default (`logits_dot_in_fp32: false`) on operands in the
compute dtype with float32 accumulation, its result rounded to the compute dtype and then cast to float32
(MaxText's `cast_logits_to_fp32: true`); with `logits_dot_in_fp32: true` on float32 operands, kept in float32.
Everything after the matmul (scale rounding aside: it is applied before the rounding), the soft cap,
logsumexp and the softmax gradient, is float32.

`OutputHead.loss_sums` computes the masked cross entropy and z-loss sums with a hand-written
gradient: the logits as the matmul rounded them are the only [tokens, vocab] residual (bfloat16 by
default: 3.9 GiB per device for gemma2-27b at batch 2 x 4096 instead of 7.8), the backward pass writes
the logit gradient once in the matmul dtype and feeds it straight to the two gradient matmuls, and
the kernel gradient comes out of the matmul in the kernel's dtype with float32 accumulation. Plain
autodiff of the same maths materialises a float32 copy of the logit gradient and transposes it (a
third of the step on XLA:CPU).

With `vocab_tiles > 1` (num_vocab_tiling) the same loss streams the vocabulary in slices: no logits
are kept, and the backward recomputes one slice at a time (one more logits matmul per step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from maxtext.errors import ConfigError
from maxtext.layers import matmul, quantization
from maxtext.layers.dtypes import cast
from maxtext.layers.sharding import constrain

_LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")
_KERNEL_AXES = ("embed", "vocab")


@dataclasses.dataclass(frozen=True)
class OutputHead:
  """logits = soft_cap(round(scale * hidden . kernel)), kernel [emb, vocab] in its stored dtype."""

  kernel: jax.Array
  dtype: Any  # compute dtype (config.dtype): the matmul's operands and the rounding of its result unless dot_in_fp32
  precision: jax.lax.Precision | None = None
  scale: float = 1.0
  soft_cap: float = 0.0
  rules: Sequence[Any] = ()
  integer_rounding: bool = False  # the platform policy's bf16 rounding (maxtext.layers.dtypes.cast)
  vocab_tiles: int = 1  # num_vocab_tiling: loss_sums streams the vocabulary in this many slices
  quant: quantization.Recipe | None = None  # quantize_logits_proj: the logits product quantized (forward; gradients straight-through)
  dot_in_fp32: bool = False  # logits_dot_in_fp32: float32 operands and float32 logits instead of dtype ones
  tied: bool = False  # the kernel is the embedding table transposed (logits_via_embedding): its gradient is made [vocab, emb]

  @property
  def _dot_dtype(self) -> Any:
    """The dtype of the logits matmul's operands, of the logits it returns and of the logit gradient."""
    return jnp.float32 if self.dot_in_fp32 else self.dtype

  def _constrain(self, x: jax.Array) -> jax.Array:
    return constrain(x, _LOGITS_AXES[-x.ndim :], self.rules)

  def _raw_logits(self, hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """Scaled, uncapped logits in the matmul dtype."""
    if self.quant is not None:
      logits = self._quantized_product(hidden, kernel)
    else:
      logits = self._product(hidden, kernel)
    return self._rounded(logits)

  def _product(self, hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """hidden . kernel on operands in the matmul dtype, float32 result: matmul.einsum's product and gradients, except
    that a tied kernel's gradient is produced as [vocab, emb], the embedding table's own layout.

    Through matmul.einsum the tied kernel's gradient is hidden^T . grad [emb, vocab], transposed back into the table
    by the autodiff of `embedding.T`. XLA:CPU folds that transpose into the bf16 product after choosing to keep it in
    bf16, leaving a dot (both operands contracted on their first axis) that neither its bf16 kernels nor its fallback
    (Eigen, no bf16) run: "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32" (a GRPO step of a tied
    model: token_log_probs differentiates these logits; loss_sums's barrier keeps the transpose apart). Written as
    grad^T . hidden, the product XLA produces is already [vocab, emb] and the two transposes cancel. Same products
    and sums: the numbers do not change."""
    head, h_dtype, k_dtype = self, hidden.dtype, kernel.dtype

    def forward(hidden, kernel):
      h, k = hidden.astype(head._dot_dtype), kernel.astype(head._dot_dtype)
      return matmul.product("...e,ev->...v", h, k, head.precision), (h, k)

    def backward(residuals, g):
      h, k = residuals
      g = g.astype(head._dot_dtype)
      d_hidden = cast(matmul.product("...v,ev->...e", g, k, head.precision), h_dtype, head.integer_rounding)
      if head.tied:
        d_kernel = cast(matmul.product("...v,...e->ve", g, h, head.precision), k_dtype, head.integer_rounding).T
      else:
        d_kernel = cast(matmul.product("...e,...v->ev", h, g, head.precision), k_dtype, head.integer_rounding)
      return d_hidden, d_kernel

    fn = jax.custom_vjp(lambda h, k: forward(h, k)[0])
    fn.defvjp(forward, backward)
    return fn(hidden, kernel)

  def _rounded(self, logits: jax.Array) -> jax.Array:
    """float32 matmul result -> scaled logits in the matmul dtype, sharded like the logits."""
    return self._constrain(cast(self._scaled(logits), self._dot_dtype, self.integer_rounding))

  def _quantized_product(self, hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """hidden . kernel with both quantized per `quant` (float32 result). Inside loss_sums the hand-written backward takes
    the gradients from the unquantized operands (straight-through), whatever the recipe does for other layers."""
    spec = quantization.trailing_spec(hidden.ndim, 1, 1)
    return quantization.einsum(spec, hidden, kernel, self.quant, self.dtype).astype(jnp.float32)

  def _scaled(self, logits: jax.Array) -> jax.Array:
    return logits * self.scale if self.scale != 1.0 else logits

  def _cap(self, logits: jax.Array) -> jax.Array:
    """Rounded logits -> float32 capped logits (MaxText's cast_logits_to_fp32, then the cap in float32)."""
    logits = logits.astype(jnp.float32)
    return self.soft_cap * jnp.tanh(logits / self.soft_cap) if self.soft_cap else logits

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., emb] -> float32 logits [..., vocab]."""
    return self._cap(self._raw_logits(hidden, self.kernel))

  def loss_sums(self, hidden: jax.Array, targets: jax.Array, mask: jax.Array, z_loss_multiplier: float) -> tuple[jax.Array, jax.Array]:
    """(sum of mask * (logsumexp - target logit), sum of mask * z_loss_multiplier * logsumexp^2)."""
    if self.vocab_tiles > 1:
      return self._streamed_loss_sums(hidden, targets, mask, z_loss_multiplier)
    head = self

    def forward(hidden, kernel, targets, mask):
      raw = head._raw_logits(hidden, kernel)  # the one [tokens, vocab] array kept (matmul dtype): float32 capped logits are recomputed from it
      lse = head._logsumexp(raw)
      target_logit = head._cap(jnp.take_along_axis(raw, targets[..., None], axis=-1)[..., 0])  # a gather: the backward is hand-written
      sums = (jnp.sum((lse - target_logit) * mask), jnp.sum(z_loss_multiplier * jnp.square(lse) * mask))
      return sums, (hidden, kernel, raw, lse, targets, mask)

    def backward(residuals, cotangents):
      hidden, kernel, raw, lse, targets, mask = residuals
      grad = head._logit_grad(raw, lse, targets, mask, cotangents, z_loss_multiplier)
      k, h = kernel.astype(head._dot_dtype), hidden.astype(head._dot_dtype)
      d_hidden = cast(matmul.product("...v,ev->...e", grad, k, head.precision), hidden.dtype, head.integer_rounding)
      # The layers' backward pass waits for the reduced kernel gradient: left alone, XLA may reduce the full-size
      # partial sums after the layer loop, while every layer's gradient is held (qwen3-235b-a22b on v5p-128: +5 GB).
      d_hidden, d_kernel = jax.lax.optimization_barrier((d_hidden, head._kernel_grad(h, grad, kernel.dtype)))
      return d_hidden, d_kernel, None, None

    fused = jax.custom_vjp(lambda h, k, t, m: forward(h, k, t, m)[0])
    fused.defvjp(forward, backward)
    return fused(hidden, self.kernel, targets, mask)

  def token_log_probs(self, hidden: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature)[target] per position: float32 [...], differentiable by autodiff.

    With vocab_tiles > 1 the vocabulary is streamed in slices (an online log-sum-exp, each slice rematerialised in
    the backward pass), so no [..., vocab] array is kept, as in loss_sums.
    """
    inv_t = 1.0 / temperature
    if self.vocab_tiles == 1:
      logits = self.logits(hidden) * inv_t
      target_logit = jnp.sum(jnp.where(_is_target(logits, targets), logits, 0.0), axis=-1)
      return target_logit - jax.nn.logsumexp(logits, axis=-1)
    emb, vocab = self.kernel.shape
    if vocab % self.vocab_tiles:
      raise ConfigError(f"vocab_size {vocab} is not divisible by num_vocab_tiling {self.vocab_tiles}; pick a divisor")
    width = vocab // self.vocab_tiles
    k_slices = jnp.moveaxis(self.kernel.reshape(emb, self.vocab_tiles, width), 1, 0)
    offsets = jnp.arange(self.vocab_tiles, dtype=jnp.int32) * width

    @jax.checkpoint
    def body(carry, xs):
      peak, total, target_logit = carry
      k_slice, offset = xs
      logits = self._cap(self._raw_logits(hidden, k_slice)) * inv_t
      new_peak = jax.lax.stop_gradient(jnp.maximum(peak, jnp.max(logits, axis=-1)))  # a shift only: lse's gradient is the softmax
      total = total * jnp.exp(peak - new_peak) + jnp.sum(jnp.exp(logits - new_peak[..., None]), axis=-1)
      target_logit = target_logit + jnp.sum(jnp.where(_is_target(logits, targets - offset), logits, 0.0), axis=-1)
      return (new_peak, total, target_logit), None

    start = (jnp.full(targets.shape, jnp.finfo(jnp.float32).min), jnp.zeros(targets.shape, jnp.float32), jnp.zeros(targets.shape, jnp.float32))
    (peak, total, target_logit), _ = jax.lax.scan(body, start, (k_slices, offsets))
    return target_logit - (peak + jnp.log(total))

  def _logsumexp(self, raw: jax.Array) -> jax.Array:
    """logsumexp over the vocabulary of the capped logits of raw (scaled, uncapped) logits.

    Capped logits lie in [-cap, cap], so while cap + ln(vocab) stays far from float32's exp limit (88) the sum of
    exp needs no max pass: one reduction reads raw, and no capped [tokens, vocab] copy is ever written (the max
    pass made XLA keep one, 7.8 GiB per device for gemma2-27b at batch 2 x 4096)."""
    if self.soft_cap and self.soft_cap + math.log(raw.shape[-1]) < 80.0:
      return jnp.log(jnp.sum(jnp.exp(self._cap(raw)), axis=-1))
    return jax.nn.logsumexp(self._cap(raw), axis=-1)

  def _logit_grad(self, raw, lse, targets, mask, cotangents, z_loss_multiplier: float, offset: int | jax.Array = 0) -> jax.Array:
    """The loss gradient w.r.t. the raw (pre-cap, pre-scale) logits of one vocabulary slice starting at offset, in the matmul
    dtype, from that slice's scaled, uncapped logits raw (in the matmul dtype; the arithmetic is float32)."""
    g_xent, g_z = cotangents
    logits = self._cap(raw)
    # d/dlogits of g_xent*(lse - target) + g_z*z*lse^2 is softmax*(g_xent + 2*g_z*z*lse) - g_xent*onehot.
    coef = (g_xent + 2.0 * z_loss_multiplier * g_z * lse) * mask
    grad = jnp.exp(logits - lse[..., None]) * coef[..., None] - jnp.where(_is_target(logits, targets - offset), (g_xent * mask)[..., None], 0.0)
    if self.soft_cap:
      grad = grad * (1.0 - jnp.square(logits / self.soft_cap))
    if self.scale != 1.0:
      grad = grad * self.scale
    return self._constrain(cast(grad, self._dot_dtype, self.integer_rounding))

  def _kernel_grad(self, h: jax.Array, grad: jax.Array, kernel_dtype: Any) -> jax.Array:
    """hidden^T . logit gradient in the kernel's dtype, sharded like the kernel, so the partial sums are
    reduce-scattered instead of all-reduced into a full [emb, vocab] copy on every device."""
    d_kernel = cast(matmul.product("...e,...v->ev", h, grad, self.precision), kernel_dtype, self.integer_rounding)
    return constrain(d_kernel, _KERNEL_AXES, self.rules)

  def _streamed_loss_sums(self, hidden: jax.Array, targets: jax.Array, mask: jax.Array, z_loss_multiplier: float) -> tuple[jax.Array, jax.Array]:
    """loss_sums over vocab_tiles slices of the vocabulary in a scan, forward and backward: an online logsumexp
    forward that keeps no logits, and a backward that recomputes one slice's logits at a time. Peak memory for the
    logits, their gradient, the gathered kernel and the kernel gradient's partial sums falls by vocab_tiles."""
    head, tiles = self, self.vocab_tiles
    emb, vocab = self.kernel.shape
    if vocab % tiles:
      raise ConfigError(f"vocab_size {vocab} is not divisible by num_vocab_tiling {tiles}; pick a divisor")
    width = vocab // tiles
    offsets = jnp.arange(tiles, dtype=jnp.int32) * width

    def slices(kernel):  # [E, V] -> [tiles, E, V/tiles] in the matmul dtype
      return jnp.moveaxis(kernel.astype(head._dot_dtype).reshape(emb, tiles, width), 1, 0)

    def slice_raw(h, k_slice):  # scaled, uncapped logits of one slice, rounded as the untiled ones
      raw = head._quantized_product(h, k_slice) if head.quant is not None else matmul.product("...e,ev->...v", h, k_slice, head.precision)
      return head._rounded(raw)

    def forward(hidden, kernel, targets, mask):
      h = hidden.astype(head._dot_dtype)

      def body(carry, xs):
        peak, total, target_logit = carry
        k_slice, offset = xs
        logits = head._cap(slice_raw(h, k_slice))
        new_peak = jnp.maximum(peak, jnp.max(logits, axis=-1))
        total = total * jnp.exp(peak - new_peak) + jnp.sum(jnp.exp(logits - new_peak[..., None]), axis=-1)
        target_logit = target_logit + jnp.sum(jnp.where(_is_target(logits, targets - offset), logits, 0.0), axis=-1)
        return (new_peak, total, target_logit), None

      start = (jnp.full(targets.shape, jnp.finfo(jnp.float32).min), jnp.zeros(targets.shape, jnp.float32), jnp.zeros(targets.shape, jnp.float32))
      (peak, total, target_logit), _ = jax.lax.scan(body, start, (slices(kernel), offsets))
      lse = peak + jnp.log(total)
      sums = (jnp.sum((lse - target_logit) * mask), jnp.sum(z_loss_multiplier * jnp.square(lse) * mask))
      return sums, (hidden, kernel, lse, targets, mask)

    def backward(residuals, cotangents):
      hidden, kernel, lse, targets, mask = residuals
      h = hidden.astype(head._dot_dtype)

      def body(d_hidden, xs):
        k_slice, offset = xs
        grad = head._logit_grad(slice_raw(h, k_slice), lse, targets, mask, cotangents, z_loss_multiplier, offset)
        d_hidden = d_hidden + matmul.product("...v,ev->...e", grad, k_slice, head.precision)
        return d_hidden, head._kernel_grad(h, grad, kernel.dtype)

      d_hidden, d_slices = jax.lax.scan(body, jnp.zeros(hidden.shape, jnp.float32), (slices(kernel), offsets))
      d_kernel = constrain(jnp.moveaxis(d_slices, 0, 1).reshape(emb, vocab), _KERNEL_AXES, head.rules)
      return cast(d_hidden, hidden.dtype, head.integer_rounding), d_kernel, None, None

    fused = jax.custom_vjp(lambda h, k, t, m: forward(h, k, t, m)[0])
    fused.defvjp(forward, backward)
    return fused(hidden, self.kernel, targets, mask)


def _is_target(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """A compare against a vocabulary iota instead of a gather, so nothing scatters into [..., vocab]."""
  return jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
