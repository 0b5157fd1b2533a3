"""Preference pairs for DPO: records -> one element per pair holding both responses, packed so a pair never straddles rows.

train_data_columns names the record's columns: [chosen, rejected] (each a whole text: the prompt is their longest
common token prefix) or [prompt, chosen, rejected]. Each response becomes a sequence BOS + prompt + response + EOS
whose loss weight covers the response tokens (and EOS) only. The element concatenates the chosen then the rejected
sequence, each already shifted (targets within its own half), truncated to max_target_length // 2 tokens so the
pair fits one row. The packer moves elements whole, so both halves land in one row; `finalize_packed_pairs` gives
pair k of a row the segment ids 2k - 1 (chosen) and 2k (rejected), positions restarting at each half.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from maxtext.data.features import ADAPTER_KEY, DocumentEncoder, finalize_packed, pad_row, shift
from maxtext.data.records import decode_record, text_field
from maxtext.errors import DataError

HALF_KEY = "pair_half"  # 1 on the chosen sequence, 2 on the rejected one
POSITION_KEY = "pair_positions"  # position within its own sequence
META_FEATURES = (HALF_KEY, POSITION_KEY)  # packed as they are (no segment ids or positions of their own)
# Why a pair is dropped.
SAME = "same"  # chosen equals rejected: nothing to compare
NO_ROOM = "no_room"  # within max_target_length // 2 tokens the responses leave no scored token, or do not differ


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


class PairEncoder(DocumentEncoder):
  """(where, raw record) -> one packed-ready element per preference pair, or None for a pair with nothing to compare."""

  def __init__(self, *args: Any, max_length: int, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.half = max_length // 2

  def sequences(self, record: dict[str, Any], where: str) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """(chosen tokens, their response mask, rejected tokens, mask) before truncation; None when the responses are equal."""
    missing = [c for c in self.columns if c not in record]
    if missing:
      keys = ", ".join(sorted(map(str, record))[:8]) or "none"
      raise DataError(
        f"{where}: no column '{missing[0]}' (columns: {keys}); use_dpo reads train_data_columns {self.columns} as "
        f"{'[prompt, chosen, rejected]' if len(self.columns) == 3 else '[chosen, rejected]'}, name your pairs' columns"
      )
    texts = [text_field(record, c, where) for c in self.columns]
    bos = [self.bos] if self.bos is not None else []
    eos = [self.eos] if self.eos is not None else []
    if len(texts) == 3:
      prompt = self.tokenizer.encode(texts[0])
      chosen, rejected = self.tokenizer.encode(texts[1]), self.tokenizer.encode(texts[2])
    else:
      whole_chosen, whole_rejected = self.tokenizer.encode(texts[0]), self.tokenizer.encode(texts[1])
      n = common_prefix(whole_chosen, whole_rejected)
      prompt, chosen, rejected = whole_chosen[:n], whole_chosen[n:], whole_rejected[n:]
    if chosen == rejected:
      return None
    context = bos + prompt
    return (
      context + chosen + eos,
      [0] * len(context) + [1] * (len(chosen) + len(eos)),
      context + rejected + eos,
      [0] * len(context) + [1] * (len(rejected) + len(eos)),
    )

  def encode(self, record: dict[str, Any], where: str) -> dict[str, np.ndarray] | None:
    return self.element(record, where)[0]

  def element(self, record: dict[str, Any], where: str) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """(the pair's element, None), or (None, why it is dropped: SAME or NO_ROOM)."""
    seqs = self.sequences(record, where)
    if seqs is None:
      return None, SAME
    halves = []
    for tokens, mask in ((seqs[0], seqs[1]), (seqs[2], seqs[3])):
      tokens, mask = np.asarray(tokens[: self.half], np.int32), np.asarray(mask[: self.half], np.int32)
      row = shift(tokens, mask)
      if len(tokens) < 2 or not row["weights"].any():
        return None, NO_ROOM  # truncation left this response without a scored token
      halves.append(row)
    if np.array_equal(halves[0]["inputs"], halves[1]["inputs"]):
      return None, NO_ROOM  # truncation cut where the responses differ: nothing to compare
    out = {k: np.concatenate([h[k] for h in halves]) for k in ("inputs", "targets", "weights")}
    out[HALF_KEY] = np.concatenate([np.full(len(h["inputs"]), i + 1, np.int32) for i, h in enumerate(halves)])
    out[POSITION_KEY] = np.concatenate([np.arange(len(h["inputs"]), dtype=np.int32) for h in halves])
    if self.adapter_column:
      out[ADAPTER_KEY] = np.full(len(out["inputs"]), self.adapter_slot(record, where), np.int32)
    return out, None


@dataclasses.dataclass
class Survey:
  """What became of the pairs read: how many, whether that was all of them, and the dropped ones by reason."""

  read: int
  complete: bool
  dropped: collections.Counter
  half: int  # max_target_length // 2: the tokens each response sequence may take
  description: str = ""  # the data read (files, dataset)

  def reasons(self) -> str:
    """'150 have chosen equal to rejected, 30 leave no room ...': the dropped pairs by reason."""
    parts = []
    same, no_room = self.dropped[SAME], self.dropped[NO_ROOM]
    if same:
      parts.append(f"{same} {'has' if same == 1 else 'have'} chosen equal to rejected")
    if no_room:
      parts.append(
        f"{no_room} {'leaves' if no_room == 1 else 'leave'} no difference to score within max_target_length // 2 = {self.half} tokens "
        "(the prompt takes the room)"
      )
    return " and ".join(parts)

  def counted(self) -> str:
    """'of the 200 pairs' or 'of the first 2000 pairs read'."""
    return f"of the {self.read} pairs" if self.complete else f"of the first {self.read} pairs read"

  def none_usable(self) -> bool:
    return self.complete and self.read > 0 and sum(self.dropped.values()) == self.read


def survey(encoder: PairEncoder, records: Iterable[tuple[str, Any]], limit: int) -> Survey:
  """Encode up to `limit` (where, raw) records and count the pairs dropped, by reason."""
  dropped: collections.Counter = collections.Counter()
  read = 0
  for where, raw in records:
    if read == limit:
      return Survey(read, False, dropped, encoder.half)
    read += 1
    _, why = encoder.element(decode_record(raw, where), where)
    if why is not None:
      dropped[why] += 1
  return Survey(read, True, dropped, encoder.half)


def _pair_segments(segment: np.ndarray, half: np.ndarray) -> np.ndarray:
  """Pair k's halves (packer segment k, half 1 or 2) -> segment ids 2k - 1 and 2k; padding stays 0."""
  return np.where(segment > 0, 2 * segment - 2 + half, 0).astype(np.int32)


def finalize_packed_pairs(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """grain packer output of pair elements -> batch keys with one segment per response."""
  out = finalize_packed(row)
  segment = _pair_segments(row["inputs_segment_ids"].astype(np.int32), row[HALF_KEY].astype(np.int32))
  out["inputs_segmentation"] = segment
  out["inputs_position"] = out["targets_position"] = row[POSITION_KEY].astype(np.int32)
  out["targets_segmentation"] = segment * (row["weights"] != 0)
  return out


def pad_pair(element: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
  """One pair alone in a row (packing=false): segments 1 (chosen) and 2 (rejected), then padding."""
  out = pad_row(element, length)
  half = np.pad(element[HALF_KEY], (0, length - len(element[HALF_KEY])))
  out["inputs_segmentation"] = half
  out["inputs_position"] = out["targets_position"] = np.pad(element[POSITION_KEY], (0, length - len(element[POSITION_KEY])))
  out["targets_segmentation"] = half * (out["targets_segmentation"] != 0)
  return out
