"""A split's global batch: its rows and the key that sets them (the iterators' and the package's checks read them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from maxtext.config import MaxTextConfig


def batch_rows(config: MaxTextConfig, split: str) -> int:
  """Rows of one global batch of split: global_batch_size_to_eval_on for eval, else global_batch_size_to_train_on."""
  return config.global_batch_size_to_eval_on if split == "eval" else config.global_batch_size_to_train_on


def batch_key(config: MaxTextConfig, split: str) -> str:
  """The key that sets split's batch size (what an error about it names)."""
  return "eval_per_device_batch_size" if split == "eval" and config.eval_per_device_batch_size else "per_device_batch_size"
