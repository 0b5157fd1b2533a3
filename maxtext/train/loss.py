"""Masked next-token cross entropy with z-loss (the output head streams the vocabulary with num_vocab_tiling > 1).

Sums (not means) are returned so micro-batches can be combined token-weighted:
loss = (sum xent + sum z + sum mtp + sum indexer KL) / total_weights + moe_aux; mtp only in training.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from maxtext.config import MaxTextConfig
from maxtext.data.features import IMAGE_KEY, PATCH_KEY
from maxtext.data.qwen3_vl_records import LAYOUT_KEYS, ROPE_KEY
from maxtext.layers import context_parallel
from maxtext.models import common_specs
from maxtext.models.mtp import mtp_xent_sum
from maxtext.vision import gemma3_encoder, llama4_preprocess, llama4_vision, qwen3_vl_encoder
from maxtext.vision.qwen3_vl import GridLayout


class LossSums(NamedTuple):
  xent: jax.Array  # sum over real tokens of -log p(target)
  z_loss: jax.Array  # sum over real tokens of z_loss_multiplier * logsumexp^2
  weights: jax.Array  # number of real tokens (targets_segmentation != 0)
  aux: jax.Array  # MoE load-balance loss (already weighted by the model)
  mtp: jax.Array  # multi-token prediction: scaled mean over modules of summed cross entropy (0 when off or in eval)
  dropped: jax.Array  # routed (token, expert) pairs dropped over expert capacity, summed over MoE layers
  load: jax.Array  # [MoE layers, num_experts] tokens routed to each expert (the aux-loss-free bias update reads it)
  indexer: jax.Array  # DeepSeek Sparse Attention: the weighted indexer KL summed over query tokens, mean over layers (0 without)


def zero_sums(config: MaxTextConfig) -> LossSums:
  """LossSums of zeros (the start of gradient accumulation)."""
  zero = jnp.zeros((), jnp.float32)
  load = jnp.zeros((config.num_decoder_layers - config.first_num_dense_layers, config.num_experts), jnp.float32)
  return LossSums(zero, zero, zero, zero, zero, zero, load, zero)


def loss_sums(model: Any, batch: dict[str, jax.Array], config: MaxTextConfig, training: bool = True) -> LossSums:
  """Forward the model on a batch and return the summed losses over its real target tokens (MTP only when training).

  Under context parallelism with load balance the per-token arrays are first put in the shards' order; the sums do
  not depend on it (multi-token prediction reorders its shifted targets the same way).
  """
  layout = common_specs.context_layout(config)
  natural, batch = batch, context_parallel.reorder_batch(batch, layout)
  hidden, pre_norm, stats = model.forward_hidden(
    batch["inputs"],
    positions=batch["inputs_position"],
    segment_ids=batch["inputs_segmentation"],
    adapter_ids=batch.get("adapter_ids"),
    images=batch_images(model, batch),
  )
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  targets = batch["targets"]
  xent, z = model.output_head().loss_sums(hidden, targets, mask, config.z_loss_multiplier)
  mtp = mtp_xent_sum(model, pre_norm, natural, config.mtp_loss_scaling_factor, layout) if training and config.mtp_num_layers else jnp.zeros((), jnp.float32)
  lb, dropped = jnp.asarray(stats["lb_loss"], jnp.float32), jnp.asarray(stats["dropped"], jnp.float32)
  indexer = jnp.asarray(stats["indexer_loss"], jnp.float32)
  return LossSums(xent, z, jnp.sum(mask), lb, mtp, dropped, jnp.asarray(stats["load"], jnp.float32), indexer)


def batch_images(model: Any, batch: dict[str, jax.Array]) -> jax.Array | None:
  """use_multimodal: the batch's images (None without them): Gemma 3's [B, M, S, S, 3] (Llama 4's tiles) from its
  per-token image chunks, Qwen3-VL's Qwen3VLImages from its rows' patches, layout and MRoPE positions."""
  if getattr(model, "vision", None) is None:
    return None
  if ROPE_KEY in batch and isinstance(model.vision, qwen3_vl_encoder.Qwen3VLVisionEncoder):  # maxtext.data.qwen3_vl_records
    layout = GridLayout(**{field: batch[key] for field, key in LAYOUT_KEYS.items()})
    return qwen3_vl_encoder.images_from_pixels(batch[PATCH_KEY], layout, batch[ROPE_KEY], model.vision.spec)
  if IMAGE_KEY not in batch:
    return None
  if isinstance(model.vision, llama4_vision.Llama4VisionEncoder):  # each row's tiles [B, L // T, S, S, 3]
    spec = model.vision.spec
    levels = gemma3_encoder.slot_levels(batch[IMAGE_KEY], batch["inputs"], spec.image_token_id, spec.tokens_per_image, spec.tile_size)
    return jnp.asarray(llama4_preprocess.pixel_table())[levels.astype(jnp.int32), jnp.arange(3)]
  return gemma3_encoder.images_from_tokens(batch[IMAGE_KEY], batch["inputs"], model.vision.spec)


def token_log_probs(model: Any, batch: dict[str, jax.Array], temperature: float = 1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(log p(target) per position [B, S] in float32 under softmax(logits / temperature), the forward's MoE statistics)."""
  hidden, _, stats = model.forward_hidden(
    batch["inputs"], positions=batch["inputs_position"], segment_ids=batch["inputs_segmentation"], adapter_ids=batch.get("adapter_ids")
  )
  return model.output_head().token_log_probs(hidden, batch["targets"], temperature), stats
