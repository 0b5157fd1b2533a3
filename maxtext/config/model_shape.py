"""The model size a config derives (global_parameter_scale) and the token mixers of its family's layer pattern, for the checks."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from maxtext.errors import ConfigError

if TYPE_CHECKING:
  from maxtext.config.maxtext_config import MaxTextConfig


def scale_dims(global_parameter_scale: int) -> dict[str, int]:
  """Multipliers for layers, heads/mlp and emb from global_parameter_scale = 2^k."""
  scale = global_parameter_scale
  if scale < 1 or scale & (scale - 1):
    raise ConfigError(f"invalid value for 'global_parameter_scale': {scale}; it must be a power of two (1, 2, 4, 8, ...)")
  q, r = divmod(int(math.log2(scale)), 3)
  return {"layers": 2**q, "heads": 2 ** (q + (r > 0)), "emb": 2 ** (q + (r > 1))}


def layer_shape(c: MaxTextConfig) -> MaxTextConfig:
  """c with the layer count it derives: num_decoder_layers is written only after the checks, and a family's layer
  pattern reads it."""
  return c.model_copy(update={"num_decoder_layers": c.base_num_decoder_layers * scale_dims(c.global_parameter_scale)["layers"]})


def mixers(c: MaxTextConfig) -> set[str]:
  """The token mixers of the family's layer pattern."""
  from maxtext.models import registry  # the config loads before any model code otherwise

  return registry.get(c.decoder_block).mixers(layer_shape(c))
