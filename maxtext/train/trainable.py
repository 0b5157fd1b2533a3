"""Which parameters the optimizer updates: `trainable_filter(config)` selects them, `split_params` splits a
parameter state into (trainable, frozen). The train state (maxtext.train.state) and the reference model
(maxtext.train.reference) both split by it."""

from __future__ import annotations

from flax import nnx

from maxtext.config import MaxTextConfig

VISION_TOWER = ("vision", "tower")  # the path of the vision tower's parameters in the Transformer (maxtext.models.decoder)


def in_vision_tower(path: tuple, _value=None) -> bool:
  """nnx filter: is the parameter at this path part of the vision tower?"""
  return tuple(str(getattr(k, "key", k)) for k in path[: len(VISION_TOWER)]) == VISION_TOWER


def trainable_filter(config: MaxTextConfig) -> nnx.filterlib.Filter:
  """nnx filter of the parameters the optimizer updates; the others are frozen.

  Every parameter, except with lora.enable_lora: only the adapters, plus the mHC connectors when
  mhc_expansion_rate > 1; and in DeepSeek Sparse Attention's dense warm-up (indexer_loss_scaling_factor > 0,
  indexer_sparse_training=false) only the lightning indexers, as the DeepSeek V3.2 report freezes the rest.
  freeze_vision_encoder_params (use_multimodal) leaves the vision tower out (vision/tower/...; its projector trains).
  """
  if config.use_indexer and config.indexer_loss_scaling_factor > 0 and not config.indexer_sparse_training:
    return nnx.All(nnx.Param, nnx.PathContains("indexer"))  # DeepSeek Sparse Attention's dense warm-up: only the indexer trains
  if not config.lora.enable_lora:
    if config.use_multimodal and config.freeze_vision_encoder_params:
      return nnx.All(nnx.Param, nnx.Not(in_vision_tower))
    return nnx.Param
  from maxtext.layers.lora import LoRAParam
  from maxtext.layers.mhc import MHCParam

  return nnx.Any(LoRAParam, MHCParam) if config.mhc_expansion_rate > 1 else LoRAParam


def split_params(params: nnx.State, config: MaxTextConfig) -> tuple[nnx.State, nnx.State]:
  """(trainable, frozen) parts of the full parameter state."""
  return nnx.split_state(params, trainable_filter(config), ...)
