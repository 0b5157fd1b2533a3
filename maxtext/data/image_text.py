"""Image-text documents (use_multimodal): text (or SFT turns) with `image_placeholder` places and a column of images.

Each place becomes `mm_tokens_per_image` ids `image_token_id` (never trained on), and its image rides along the
tokens as the per-token feature IMAGE_KEY: the image resized to image_size x image_size (uint8 HWC, as the HF
processor resizes), flattened and cut into mm_tokens_per_image equal chunks, chunk k on the k-th placeholder token
(zeros elsewhere). Truncation, chunking and packing move it with its tokens; the model puts the chunks back
together (maxtext.vision.gemma3_encoder.images_from_tokens), so a packed row holds any mix of documents and images.
An example must fit one row (max_target_length) with its images whole.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from maxtext.data.features import IMAGE_KEY, DocumentEncoder
from maxtext.data.images import read_image
from maxtext.errors import DataError
from maxtext.vision import llama4_preprocess, preprocess


def chunk_size(image_size: int, tokens_per_image: int) -> int:
  """Bytes of a resized image each of its placeholder tokens carries."""
  return math.ceil(image_size * image_size * 3 / tokens_per_image)


def record_dir(where: str) -> Path | None:
  """The directory of the file a record came from, for paths relative to it (jsonl records are '<path> line <n>')."""
  if " line " not in where:
    return None
  return Path(where.rsplit(" line ", 1)[0]).parent


def record_images(record: dict[str, Any], column: str, max_images: int, where: str) -> list[np.ndarray]:
  """The RGB uint8 images of the record's image column (one or a list; none when absent); a DataError past max_images (> 0)."""
  value = record.get(column)
  if value is None:
    return []
  if isinstance(value, np.ndarray) and value.dtype == object:
    value = value.tolist()
  items = value if isinstance(value, list) else [value]
  if 0 < max_images < len(items):
    raise DataError(f"{where} has {len(items)} images, more than max_num_images_per_example={max_images}; drop some or raise the limit")
  return [read_image(item, record_dir(where), f"{where} image {i}") for i, item in enumerate(items)]


def places_error(where: str, places: int, images: int, placeholder: str, column: str) -> DataError:
  return DataError(f"{where} has {places} '{placeholder}' place(s) but {images} image(s) in column '{column}'; give one image per place")


class RecordPlaces:
  """An encoder's per-thread `_places`: what it met while encoding the current record (grain maps records on several
  threads). Left out when grain pickles the encoder for its worker processes, and made afresh there."""

  def __getstate__(self) -> dict[str, Any]:
    return {k: v for k, v in self.__dict__.items() if k != "_places"}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._places = threading.local()


class ImageTextEncoder(RecordPlaces, DocumentEncoder):
  """DocumentEncoder whose documents also carry IMAGE_KEY: the images of the record's image column at its places."""

  def __init__(
    self, *args, image_column: str, placeholder: str, image_token_id: int, tokens_per_image: int, image_size: int, max_length: int, max_images: int, **kwargs
  ):
    super().__init__(*args, **kwargs)
    self.image_column, self.placeholder = image_column, placeholder
    self.image_token_id, self.tokens_per_image, self.image_size = image_token_id, tokens_per_image, image_size
    self.max_length, self.max_images = max_length, max_images
    self.chunk = chunk_size(image_size, tokens_per_image)
    self._places = threading.local()  # places met while encoding the current record (grain maps records on several threads)

  def encode_text(self, text: str) -> list[int]:
    """The text's tokens with the k-th placeholder replaced by the k-th image's ids (image_pieces)."""
    parts = text.split(self.placeholder)
    ids = self.tokenizer.encode(parts[0]) if parts[0] else []
    for part in parts[1:]:
      k = self._places.count
      ids += self._places.ids[k] if k < len(self._places.ids) else []  # a place without an image is reported after
      self._places.count += 1
      ids += self.tokenizer.encode(part) if part else []
    return ids

  def images_of(self, record: dict[str, Any], where: str) -> list[np.ndarray]:
    return record_images(record, self.image_column, self.max_images, where)

  def image_pieces(self, image: np.ndarray, where: str) -> tuple[np.ndarray, list[int]]:
    """An image's slots (uint8 [n, S, S, 3], the tower's inputs before normalising) and the ids standing for it in the
    text (tokens_per_image placeholders per slot, and any markers): Gemma 3's one resized image."""
    return preprocess.resize_bilinear(image, self.image_size)[None], [self.image_token_id] * self.tokens_per_image

  def encode(self, record: dict[str, Any], where: str) -> dict[str, np.ndarray] | None:
    images = self.images_of(record, where)
    pieces = [self.image_pieces(image, f"{where} image {i}") for i, image in enumerate(images)]
    self._places.count, self._places.ids = 0, [ids for _, ids in pieces]
    doc = super().encode(record, where)
    if self._places.count != len(images):
      raise places_error(where, self._places.count, len(images), self.placeholder, self.image_column)
    if doc is None:
      return None
    tokens = doc["tokens"]
    if images and len(tokens) > self.max_length:
      raise DataError(
        f"{where} has {len(tokens)} tokens with its {len(images)} image(s) of {sum(len(ids) for _, ids in pieces)} tokens, more than max_target_length={self.max_length}: "
        "an example with images must fit one row; shorten it, use fewer images or raise max_target_length"
      )
    is_image = tokens == self.image_token_id
    doc["mask"] = np.where(is_image, 0, doc["mask"]).astype(np.int32)  # placeholders are never targets
    pixels = np.zeros((len(tokens), self.chunk), np.uint8)
    if images:
      slots = np.concatenate([slot for slot, _ in pieces])
      flat = np.zeros((len(slots), self.tokens_per_image * self.chunk), np.uint8)
      flat[:, : slots[0].size] = slots.reshape(len(slots), -1)
      pixels[is_image] = flat.reshape(len(slots) * self.tokens_per_image, self.chunk)
    doc[IMAGE_KEY] = pixels
    return doc


class Llama4ImageTextEncoder(ImageTextEncoder):
  """Llama 4's documents: each image cut into tiles as Llama4ImageProcessor does (max_num_tiles_for_vit; image_size is
  the tile side), its place Llama4Processor's text for its tile grid (image_text: tokens_per_image placeholders per
  tile, the markers around them as the tokenizer encodes them)."""

  def __init__(self, *args, max_tiles: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.max_tiles = max_tiles
    self.marker_ids = {marker: self.tokenizer.encode(marker) for marker in llama4_preprocess.MARKERS}

  def image_pieces(self, image: np.ndarray, where: str) -> tuple[np.ndarray, list[int]]:
    tiles, grid = llama4_preprocess.llama4_tile_levels(image, self.image_size, self.max_tiles)
    return tiles, llama4_preprocess.image_ids(grid, self.tokens_per_image, self.image_token_id, self.marker_ids)
