"""Which parameters the optimizer updates: `trainable_filter(config)` selects them, `split_params` splits a
parameter state into (trainable, frozen). The train state (maxtext.train.state) and the reference model
(maxtext.train.reference) both split by it."""

from __future__ import annotations

from flax import nnx

from maxtext.config import MaxTextConfig


def trainable_filter(config: MaxTextConfig) -> nnx.filterlib.Filter:
  """nnx filter of the parameters the optimizer updates; the others are frozen.

  Every parameter, except with lora.enable_lora: only the adapters, plus the mHC connectors when
  mhc_expansion_rate > 1.
  """
  if not config.lora.enable_lora:
    return nnx.Param
  from maxtext.layers.lora import LoRAParam
  from maxtext.layers.mhc import MHCParam

  return nnx.Any(LoRAParam, MHCParam) if config.mhc_expansion_rate > 1 else LoRAParam


def split_params(params: nnx.State, config: MaxTextConfig) -> tuple[nnx.State, nnx.State]:
  """(trainable, frozen) parts of the full parameter state."""
  return nnx.split_state(params, trainable_filter(config), ...)
