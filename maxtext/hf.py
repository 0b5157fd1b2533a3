"""`from_hf(hf_dir)`: a Hugging Face model directory -> (maxtext model, config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from maxtext.config import MaxTextConfig, from_overrides
from maxtext.convert import hf_config, hf_params, safetensors_io
from maxtext.convert.model_params import model_from_flat
from maxtext.models import Transformer


def config_from_hf(hf_dir: str | Path, **config_overrides: Any) -> MaxTextConfig:
  """The maxtext config for a HF model directory; keyword overrides win (e.g. scan_layers=False)."""
  overrides = hf_config.read_overrides(hf_dir)
  overrides.update(config_overrides)
  return from_overrides(**overrides)


def params_from_hf(hf_dir: str | Path, config: MaxTextConfig) -> dict[str, np.ndarray]:
  """The directory's safetensors as flat maxtext params for config: every tensor consumed (DeepSeek's MTP layers past
  mtp_num_layers aside), every weight a finite float, else a one-line ConfigError."""
  stored_mtp = hf_config.stored_mtp_layers(safetensors_io.read_config(hf_dir), str(Path(hf_dir) / "config.json"))
  return hf_params.hf_to_maxtext(safetensors_io.read_tensors(hf_dir), config, stored_mtp)


def from_hf(hf_dir: str | Path, **config_overrides: Any) -> tuple[Transformer, MaxTextConfig]:
  """Load a Hugging Face checkpoint (config.json + safetensors). model(tokens) -> logits [B, S, vocab]."""
  config = config_from_hf(hf_dir, **config_overrides)
  return model_from_flat(config, params_from_hf(hf_dir, config)), config
