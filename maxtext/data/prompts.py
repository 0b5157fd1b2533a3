"""Prompt data for GRPO: records -> prompts (tokens and text) with the record's columns, for rollouts and rewards.

The prompt is the text of column train_data_columns[0], tokenized as BOS + prompt (no EOS: the model continues it)
and cut from the left to at most max_prefill_predict_length tokens. Every column of the record travels with it,
text decoded, so reward functions can read them (a reference answer, a target word, ...). With lora.adapter_column,
the record's adapter slot travels too. The batches of prompts are maxtext.data.prompt_iterator's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from maxtext.data.features import NO_ADAPTER, DocumentEncoder
from maxtext.data.records import text_field

Prompt = dict[str, Any]  # {"tokens": int32 [n], "text": str, "where": record location, "fields": {column: value}, "adapter": slot or -1}


def _plain(value: Any) -> Any:
  """A record value as reward functions expect it: text for bytes, Python scalars and lists for numpy values."""
  if isinstance(value, bytes):
    return value.decode("utf-8", "replace")
  if isinstance(value, np.ndarray):
    return value.item() if value.ndim == 0 else [_plain(v) for v in value.tolist()]
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, list):
    return [_plain(v) for v in value]
  return value


class PromptEncoder(DocumentEncoder):
  """(where, raw record) -> a Prompt, or None when it has no token to continue from."""

  def __init__(self, *args: Any, max_length: int, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.max_length = max_length

  def encode(self, record: dict[str, Any], where: str) -> Prompt | None:
    text = text_field(record, self.columns[0], where)
    ids = self.tokenizer.encode(text) if text.strip() else []
    if self.bos is not None:
      ids = [self.bos] + ids[len(ids) - self.max_length + 1 :] if len(ids) >= self.max_length else [self.bos] + ids
    else:
      ids = ids[-self.max_length :]
    if not ids:
      return None
    return {
      "tokens": np.asarray(ids, np.int32),
      "text": text,
      "where": where,
      "fields": {str(k): _plain(v) for k, v in record.items()},
      "adapter": self.adapter_slot(record, where) if self.adapter_column else NO_ADAPTER,
    }
