"""The output head: final hidden states -> float32 logits, and a fused logits + cross entropy.

`OutputHead.loss_sums` computes the masked cross entropy and z-loss sums with a hand-written
gradient: the float32 logits are the only [tokens, vocab] residual, the backward pass writes the
logit gradient once in the compute dtype and feeds it straight to the two gradient matmuls, and
the kernel gradient comes out of the matmul in the kernel's dtype with float32 accumulation. Plain
autodiff of the same maths rounds the logits to the compute dtype and back, materialises a
float32 copy of the logit gradient and transposes it (a third of the step on XLA:CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from maxtext.layers import matmul
from maxtext.layers.dtypes import cast
from maxtext.layers.sharding import constrain

_LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")


@dataclasses.dataclass(frozen=True)
class OutputHead:
  """logits = soft_cap(scale * hidden . kernel), kernel [emb, vocab] in its stored dtype."""

  kernel: jax.Array
  dtype: Any  # matmul input dtype (config.dtype)
  precision: jax.lax.Precision | None = None
  scale: float = 1.0
  soft_cap: float = 0.0
  rules: Sequence[Any] = ()
  integer_rounding: bool = False  # the platform policy's bf16 rounding (maxtext.layers.dtypes.cast)

  def _constrain(self, x: jax.Array) -> jax.Array:
    return constrain(x, _LOGITS_AXES[-x.ndim :], self.rules)

  def _raw_logits(self, hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    logits = matmul.einsum(
      "...e,ev->...v", hidden, kernel, dtype=self.dtype, precision=self.precision, out_dtype=jnp.float32, integer_rounding=self.integer_rounding
    )
    if self.scale != 1.0:
      logits = logits * self.scale
    return self._constrain(logits)

  def _cap(self, logits: jax.Array) -> jax.Array:
    return self.soft_cap * jnp.tanh(logits / self.soft_cap) if self.soft_cap else logits

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., emb] -> float32 logits [..., vocab]."""
    return self._cap(self._raw_logits(hidden, self.kernel))

  def loss_sums(self, hidden: jax.Array, targets: jax.Array, mask: jax.Array, z_loss_multiplier: float) -> tuple[jax.Array, jax.Array]:
    """(sum of mask * (logsumexp - target logit), sum of mask * z_loss_multiplier * logsumexp^2)."""
    head = self

    def forward(hidden, kernel, targets, mask):
      logits = head._cap(head._raw_logits(hidden, kernel))
      lse = jax.nn.logsumexp(logits, axis=-1)
      target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # a gather: the backward is hand-written
      sums = (jnp.sum((lse - target_logit) * mask), jnp.sum(z_loss_multiplier * jnp.square(lse) * mask))
      return sums, (hidden, kernel, logits, lse, targets, mask)

    def backward(residuals, cotangents):
      hidden, kernel, logits, lse, targets, mask = residuals
      g_xent, g_z = cotangents
      # d/dlogits of g_xent*(lse - target) + g_z*z*lse^2 is softmax*(g_xent + 2*g_z*z*lse) - g_xent*onehot.
      coef = (g_xent + 2.0 * z_loss_multiplier * g_z * lse) * mask
      grad = jnp.exp(logits - lse[..., None]) * coef[..., None] - jnp.where(_is_target(logits, targets), (g_xent * mask)[..., None], 0.0)
      if head.soft_cap:
        grad = grad * (1.0 - jnp.square(logits / head.soft_cap))
      if head.scale != 1.0:
        grad = grad * head.scale
      grad = head._constrain(cast(grad, head.dtype, head.integer_rounding))
      k, h = kernel.astype(head.dtype), hidden.astype(head.dtype)
      d_hidden = cast(matmul.product("...v,ev->...e", grad, k, head.precision), hidden.dtype, head.integer_rounding)
      d_kernel = cast(matmul.product("...e,...v->ev", h, grad, head.precision), kernel.dtype, head.integer_rounding)
      return d_hidden, d_kernel, None, None

    fused = jax.custom_vjp(lambda h, k, t, m: forward(h, k, t, m)[0])
    fused.defvjp(forward, backward)
    return fused(hidden, self.kernel, targets, mask)


def _is_target(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """A compare against a vocabulary iota instead of a gather, so nothing scatters into [..., vocab]."""
  return jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
