"""`from_hf(hf_dir)`: a Hugging Face model directory -> (maxtext model, config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from maxtext.config import MaxTextConfig, from_overrides
from maxtext.convert import hf_config, hf_params, safetensors_io
from maxtext.convert.model_params import model_from_flat
from maxtext.models import Transformer


def config_from_hf(hf_dir: str | Path, **config_overrides: Any) -> MaxTextConfig:
  """The maxtext config for a HF model directory; keyword overrides win (e.g. scan_layers=False)."""
  overrides = hf_config.overrides_from_hf(safetensors_io.read_config(hf_dir))
  overrides.update(config_overrides)
  return from_overrides(**overrides)


def from_hf(hf_dir: str | Path, **config_overrides: Any) -> tuple[Transformer, MaxTextConfig]:
  """Load a Hugging Face checkpoint (config.json + safetensors). model(tokens) -> logits [B, S, vocab]."""
  config = config_from_hf(hf_dir, **config_overrides)
  flat = hf_params.hf_to_maxtext(safetensors_io.read_tensors(hf_dir), config)
  return model_from_flat(config, flat), config
