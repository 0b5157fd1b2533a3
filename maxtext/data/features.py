"""Documents -> token rows: tokenize (text or SFT), truncate or chunk, shift targets, pad or finalize packed rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain.experimental as gx
import numpy as np

from maxtext.data import sft
from maxtext.data.chat_template import ChatTemplate
from maxtext.data.records import decode_record, text_field
from maxtext.errors import ConfigError, DataError
from maxtext.tokenizer import Tokenizer

BATCH_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position", "targets_segmentation")
# Features packed by grain; each gets `<name>_segment_ids` and `<name>_positions` beside it.
PACKED_FEATURES = ("inputs", "targets", "weights")
# Per-token LoRA adapter slot (lora.adapter_column): a document feature, a row feature and a batch key; -1 on padding.
ADAPTER_KEY = "adapter_ids"
NO_ADAPTER = -1
# Mixture component of a document (maxtext.data.mixture): 1 + its index on the document's first token, 0 elsewhere
# (and on padding). A row and local-batch feature only: the DataIterator counts it and drops it from the batch.
MIXTURE_KEY = "mixture_starts"
# use_multimodal: each token's chunk of its image's pixels, uint8 [L, chunk] (maxtext.data.image_text).
IMAGE_KEY = "image_pixels"
# Qwen3-VL (maxtext.data.qwen3_vl_records): a document's image patches and their grids, features of the patches'
# own length (packed to max_patches_per_row_for_vit, not per token); whole documents only (they fit one row).
PATCH_KEY = "image_patches"
GRID_KEY = "image_grids"
PATCH_FEATURES = (PATCH_KEY, GRID_KEY)


def packed_features(with_adapters: bool, with_images: bool = False) -> tuple[str, ...]:
  return PACKED_FEATURES + ((ADAPTER_KEY,) if with_adapters else ()) + ((IMAGE_KEY,) if with_images else ())


class DocumentEncoder:
  """(where, raw record) -> {'tokens', 'mask'} (int32 vectors) or None for a document with nothing to learn.

  mask[i] = 1 when token i is trained on as a target (i.e. predicting it carries loss weight). With an
  adapter_column, 'adapter_ids' repeats the document's adapter slot (its name's index in adapter_names, or an
  integer slot) for every token.
  """

  def __init__(
    self,
    tokenizer: Tokenizer,
    columns: Sequence[str],
    add_bos: bool,
    add_eos: bool,
    use_sft: bool = False,
    completion_only: bool = True,
    chat_template: sft.TemplateSource | None = None,
    adapter_column: str = "",
    adapter_names: Sequence[str] = (),
  ):
    self.tokenizer = tokenizer
    self.adapter_column = adapter_column
    self.adapter_names = list(adapter_names)
    self.columns = list(columns)
    self.bos = tokenizer.bos_id if add_bos else None
    self.eos = tokenizer.eos_id if add_eos else None
    if add_bos and tokenizer.bos_id is None:
      raise ConfigError(f"add_bos is true but the tokenizer '{tokenizer.path}' has no BOS token; set add_bos=false")
    if add_eos and tokenizer.eos_id is None:
      raise ConfigError(f"add_eos is true but the tokenizer '{tokenizer.path}' has no EOS token; set add_eos=false")
    self.use_sft = use_sft
    self.completion_only = completion_only
    self.chat_template = None if chat_template is None else ChatTemplate(chat_template)  # compiled now: a bad template fails here

  def pieces(self, record: dict[str, Any], where: str) -> list[sft.Piece]:
    """The document as (text, trainable) pieces."""
    if not self.use_sft:
      return [("\n".join(text_field(record, c, where) for c in self.columns), True)]
    if len(self.columns) == 2:
      return sft.prompt_completion(text_field(record, self.columns[0], where), text_field(record, self.columns[1], where))
    column = self.columns[0]
    if isinstance(record.get(column), np.ndarray):  # a list column read from parquet
      record = {**record, column: record[column].tolist()}
    if len(self.columns) != 1 or not isinstance(record.get(column), list):
      if column not in record:
        text_field(record, column, where)  # raises the missing-column error
      raise DataError(f"{where}: use_sft needs a messages column (list of role/content turns) or two prompt/completion columns; set train_data_columns")
    if self.chat_template is None:
      raise ConfigError(
        f"use_sft with a messages column needs a chat template and tokenizer '{self.tokenizer.path}' has none; set chat_template or chat_template_path"
      )
    messages = sft.check_messages(record[column], where)
    return self.chat_template.pieces(messages, self.tokenizer.special_tokens, where)

  def renders_template(self) -> bool:
    """Whether documents are conversations rendered by a chat template (which may hold BOS and EOS itself)."""
    return self.use_sft and len(self.columns) == 1

  def encode(self, record: dict[str, Any], where: str) -> dict[str, np.ndarray] | None:
    """BOS + the pieces' tokens + EOS; a chat template's output that already starts with BOS (or ends with EOS,
    whitespace after it aside) gets no second one."""
    pieces = [(text, trainable) for text, trainable in self.pieces(record, where) if text.strip()]
    if not pieces:
      return None
    ids: list[int] = []
    mask: list[int] = []
    for text, trainable in pieces:
      tokens = self.encode_text(text)
      ids += tokens
      mask += [int(trainable or not self.completion_only)] * len(tokens)
    templated = self.renders_template()
    if self.bos is not None and not (templated and ids[:1] == [self.bos]):
      ids.insert(0, self.bos)
      mask.insert(0, 0)
    if self.eos is not None and not (templated and self.ends_with_eos(ids)):
      ids.append(self.eos)
      mask.append(int(pieces[-1][1] or not self.completion_only))
    if len(ids) < 2:
      return None
    doc = {"tokens": np.asarray(ids, np.int32), "mask": np.asarray(mask, np.int32)}
    if self.adapter_column:
      doc[ADAPTER_KEY] = np.full(len(ids), self.adapter_slot(record, where), np.int32)
    return doc

  def encode_text(self, text: str) -> list[int]:
    """One piece's tokens (image-text documents also place their images here: maxtext.data.image_text)."""
    return self.tokenizer.encode(text)

  def ends_with_eos(self, ids: list[int]) -> bool:
    """Whether the last EOS in ids is followed by nothing but whitespace."""
    if self.eos not in ids:
      return False
    last = len(ids) - 1 - ids[::-1].index(self.eos)
    return not self.tokenizer.decode(ids[last + 1 :]).strip()

  def adapter_slot(self, record: dict[str, Any], where: str) -> int:
    """The slot named by the record's adapter column: an adapter name or an integer slot; else a DataError."""
    value = record.get(self.adapter_column)
    if isinstance(value, bytes):
      value = value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray) and value.ndim == 0:
      value = value.item()
    if isinstance(value, str) and value in self.adapter_names:
      return self.adapter_names.index(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < len(self.adapter_names):
      return int(value)
    what = "has no column" if self.adapter_column not in record else f"names adapter {value!r} in column"
    raise DataError(
      f"{where} {what} '{self.adapter_column}' (lora.adapter_column); use one of the adapters {self.adapter_names} "
      f"or a slot 0..{len(self.adapter_names) - 1}, or fix lora.lora_adapters"
    )

  def __call__(self, item: tuple[str, Any]) -> dict[str, np.ndarray] | None:
    where, raw = item
    return self.encode(decode_record(raw, where), where)


def shift(tokens: np.ndarray, mask: np.ndarray, adapters: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Inputs are the tokens; targets are the next token within the row; the last token has target 0 and weight 0.

  adapters (the document's per-token adapter slots) ride along unshifted: they belong to the input tokens.
  """
  zero = np.zeros(1, np.int32)
  row = {"inputs": tokens, "targets": np.concatenate([tokens[1:], zero]), "weights": np.concatenate([mask[1:], zero])}
  if adapters is not None:
    row[ADAPTER_KEY] = adapters
  return row


def _span(doc: dict[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
  adapters = doc.get(ADAPTER_KEY)
  row = shift(doc["tokens"][start:stop], doc["mask"][start:stop], None if adapters is None else adapters[start:stop])
  for key in (MIXTURE_KEY, IMAGE_KEY):
    if key in doc:
      row[key] = doc[key][start:stop]
  for key in PATCH_FEATURES:
    if key in doc:
      row[key] = doc[key]
  return row


def truncate(doc: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
  return _span(doc, 0, length)


def chunk(doc: dict[str, np.ndarray], length: int) -> list[dict[str, np.ndarray]]:
  """Consecutive rows of at most `length` tokens; a trailing piece of a single token is dropped (no target)."""
  n = len(doc["tokens"])
  return [_span(doc, i, i + length) for i in range(0, n, length) if n - i > 1]


class ChunkTransform(gx.FlatMapTransform):
  """grain flat-map: one document -> its rows of at most max_target_length tokens."""

  max_fan_out = 1 << 30

  def __init__(self, length: int):
    self.length = length

  def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    return chunk(element, self.length)


def pad_row(row: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
  """An unpacked row: one segment (id 1) padded with segment 0 to `length`."""
  n = len(row["inputs"])
  pad = length - n

  def padded(x: np.ndarray) -> np.ndarray:
    return np.pad(x.astype(np.int32), (0, pad))

  segment = padded(np.ones(n, np.int32))
  positions = padded(np.arange(n, dtype=np.int32))
  out = {
    "inputs": padded(row["inputs"]),
    "inputs_position": positions,
    "inputs_segmentation": segment,
    "targets": padded(row["targets"]),
    "targets_position": positions,
    "targets_segmentation": segment * padded(row["weights"]),
  }
  if ADAPTER_KEY in row:
    out[ADAPTER_KEY] = np.pad(row[ADAPTER_KEY].astype(np.int32), (0, pad), constant_values=NO_ADAPTER)
  if MIXTURE_KEY in row:
    out[MIXTURE_KEY] = padded(row[MIXTURE_KEY])
  if IMAGE_KEY in row:
    out[IMAGE_KEY] = np.pad(row[IMAGE_KEY], ((0, pad), (0, 0)))
  for key in PATCH_FEATURES:  # padded to the patch budget by qwen3_vl_records.RowImages
    if key in row:
      out[key] = row[key]
  return out


def finalize_packed(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """grain packer output -> batch keys; a target's segment id is zeroed where its weight is 0."""
  segment = row["inputs_segment_ids"].astype(np.int32)
  positions = row["inputs_positions"].astype(np.int32)
  out = {
    "inputs": row["inputs"].astype(np.int32),
    "inputs_position": positions,
    "inputs_segmentation": segment,
    "targets": row["targets"].astype(np.int32),
    "targets_position": positions,
    "targets_segmentation": segment * (row["weights"] != 0),
  }
  if ADAPTER_KEY in row:  # the packer pads with 0, a real slot: padding goes to the base model instead
    out[ADAPTER_KEY] = np.where(segment == 0, NO_ADAPTER, row[ADAPTER_KEY]).astype(np.int32)
  if MIXTURE_KEY in row:  # the packer pads with 0: no document starts there
    out[MIXTURE_KEY] = row[MIXTURE_KEY].astype(np.int32)
  if IMAGE_KEY in row:
    out[IMAGE_KEY] = row[IMAGE_KEY]
  for key in PATCH_FEATURES:
    if key in row:
      out[key] = row[key]
  return out
