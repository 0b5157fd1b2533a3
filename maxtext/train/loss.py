"""Masked next-token cross entropy with z-loss, optionally over vocabulary tiles.

Sums (not means) are returned so micro-batches can be combined token-weighted:
loss = (sum xent + sum z) / total_weights + moe_aux.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError
from maxtext.layers.output_head import OutputHead


class LossSums(NamedTuple):
  xent: jax.Array  # sum over real tokens of -log p(target)
  z_loss: jax.Array  # sum over real tokens of z_loss_multiplier * logsumexp^2
  weights: jax.Array  # number of real tokens (targets_segmentation != 0)
  aux: jax.Array  # MoE load-balance loss (already weighted by the model)


def _tiled_sums(head: OutputHead, hidden: jax.Array, targets: jax.Array, mask: jax.Array, tiles: int, z_mult: float) -> tuple[jax.Array, jax.Array]:
  """Logits and loss per chunk of tokens inside a rematerialised scan: [B, S, V] logits never exist."""
  b, s, e = hidden.shape
  if s % tiles:
    raise ConfigError(f"max_target_length {s} is not divisible by num_vocab_tiling {tiles}; pick a divisor")

  def chunks(x):  # [B, S, ...] -> [tiles, B, S/tiles, ...]; the batch axis keeps its sharding
    return jnp.swapaxes(x.reshape(b, tiles, s // tiles, *x.shape[2:]), 0, 1)

  @jax.checkpoint
  def body(carry, chunk):
    h, t, m = chunk
    xent, z = head.loss_sums(h, t, m, z_mult)
    return (carry[0] + xent, carry[1] + z), None

  zero = jnp.zeros((), jnp.float32)
  (xent, z), _ = jax.lax.scan(body, (zero, zero), (chunks(hidden), chunks(targets), chunks(mask)))
  return xent, z


def loss_sums(model: Any, batch: dict[str, jax.Array], config: MaxTextConfig) -> LossSums:
  """Forward the model on a batch and return the summed losses over its real target tokens."""
  hidden, aux = model.hidden_states(
    batch["inputs"], positions=batch["inputs_position"], segment_ids=batch["inputs_segmentation"], adapter_ids=batch.get("adapter_ids")
  )
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  targets = batch["targets"]
  if config.num_vocab_tiling > 1:
    xent, z = _tiled_sums(model.output_head(), hidden, targets, mask, config.num_vocab_tiling, config.z_loss_multiplier)
  else:
    xent, z = model.output_head().loss_sums(hidden, targets, mask, config.z_loss_multiplier)
  return LossSums(xent, z, jnp.sum(mask), jnp.asarray(aux, jnp.float32))
