"""Qwen3-VL image-text documents (use_multimodal, vision_encoder_block=qwen3_vl): text (or SFT turns) with
`image_placeholder` places and a column of images, as Hugging Face's Qwen3-VL processor prepares them.

Each image is resized (PIL bicubic) to smart_resize's size within [min_pixels_for_vit, image_size_for_vit^2], sides
multiples of p m (p the patch, m the spatial merge size), and cut into its grid (1, h, w) of p x p patches in
spatial-merge-block order. Its place becomes h w / m^2 ids image_token_id (its merged tokens, never trained on).
A document carries its images' patches as two features of their own length (not per token):

    PATCH_KEY  uint8 [n, C p p]   the resized pixels of every patch, images in order (normalised on device)
    GRID_KEY   int32 [n, 3]       an image's grid (t, h, w) on its first patch, zeros on the others

Packing fills a row's max_target_length tokens and its max_patches_per_row_for_vit patches both, keeping the
documents (and so their images) in one order; `RowImages` then gives the row the tower's inputs: the patches padded
to the budget, their GridLayout (each image attends within itself) and every token's MRoPE position, restarting at
each document's first token, so a packed row computes what its documents alone would.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from maxtext.data.features import GRID_KEY, PATCH_KEY, DocumentEncoder
from maxtext.data.image_text import RecordPlaces, places_error, record_images
from maxtext.errors import ConfigError, DataError
from maxtext.vision import preprocess, qwen3_vl_encoder
from maxtext.vision.qwen3_vl import GridLayout
from maxtext.vision.qwen3_vl_encoder import Qwen3VLEncoderSpec, layout_padded, rope_index

ROPE_KEY = "rope_positions"
LAYOUT_KEYS = {"rows_cols": "image_rows_cols", "taps": "image_taps", "weights": "image_weights", "segments": "image_segments"}  # GridLayout field -> batch key


def patch_budget(config: Any, spec: Qwen3VLEncoderSpec) -> int:
  """Patches a row holds: max_patches_per_row_for_vit, or (0) the most one image of image_size_for_vit^2 pixels has."""
  try:
    return qwen3_vl_encoder.patch_budget(spec, config.max_patches_per_row_for_vit)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def batch_layout(spec: Qwen3VLEncoderSpec, budget: int, length: int) -> dict[str, tuple[tuple[int, ...], type]]:
  """The image keys of a row: key -> (shape without the batch dimension, dtype)."""
  t = spec.tower
  return {
    PATCH_KEY: ((budget, t.num_channels * t.patch_size**2), np.uint8),
    LAYOUT_KEYS["rows_cols"]: ((budget, 2), np.int32),
    LAYOUT_KEYS["taps"]: ((budget, 4), np.int32),
    LAYOUT_KEYS["weights"]: ((budget, 4), np.float32),
    LAYOUT_KEYS["segments"]: ((budget,), np.int32),
    ROPE_KEY: ((length, 3), np.int32),
  }


def batch_dtypes(config: Any) -> dict[str, type]:
  """The image keys of a Qwen3-VL image-text batch and their dtypes."""
  from maxtext.models import vision_specs

  spec = vision_specs.vision(config)
  return {key: dtype for key, (_, dtype) in batch_layout(spec, patch_budget(config, spec), config.max_target_length).items()}


class Qwen3VLImageTextEncoder(RecordPlaces, DocumentEncoder):
  """DocumentEncoder whose documents also carry PATCH_KEY and GRID_KEY: the images of the record's image column."""

  def __init__(self, *args, image_column: str, placeholder: str, spec: Qwen3VLEncoderSpec, max_length: int, max_images: int, budget: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.image_column, self.placeholder, self.spec = image_column, placeholder, spec
    self.max_length, self.max_images, self.budget = max_length, max_images, budget
    self._places = threading.local()  # the current record's image sizes and places met (grain maps records on several threads)

  def encode_text(self, text: str) -> list[int]:
    """The text's tokens with the k-th placeholder replaced by the k-th image's merged-token count of image ids."""
    parts = text.split(self.placeholder)
    ids = self.tokenizer.encode(parts[0]) if parts[0] else []
    sizes = self._places.sizes
    for part in parts[1:]:
      k = self._places.count
      ids += [self.spec.image_token_id] * (sizes[k] if k < len(sizes) else 0)  # a place without an image is reported after
      self._places.count += 1
      ids += self.tokenizer.encode(part) if part else []
    return ids

  def patches_of(self, record: dict[str, Any], where: str) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
    t = self.spec.tower
    tiles, grids = [], []
    for i, image in enumerate(record_images(record, self.image_column, self.max_images, where)):
      try:
        patches, grid = preprocess.qwen3_vl_image_patches(
          image, patch_size=t.patch_size, merge_size=t.spatial_merge_size, min_pixels=self.spec.min_pixels, max_pixels=self.spec.max_pixels
        )
      except ValueError as e:
        raise DataError(f"{where} image {i}: {e}; crop or drop the image") from None
      tiles.append(patches.reshape(patches.shape[0], -1))
      grids.append(grid)
    return tiles, grids

  def encode(self, record: dict[str, Any], where: str) -> dict[str, np.ndarray] | None:
    tiles, grids = self.patches_of(record, where)
    self._places.count, self._places.sizes = 0, [t * h * w // self.spec.merge_size**2 for t, h, w in grids]
    doc = super().encode(record, where)
    if self._places.count != len(grids):
      raise places_error(where, self._places.count, len(grids), self.placeholder, self.image_column)
    if doc is None:
      return None
    tokens = doc["tokens"]
    if grids and len(tokens) > self.max_length:
      raise DataError(
        f"{where} has {len(tokens)} tokens with its {len(grids)} image(s), more than max_target_length={self.max_length}: "
        "an example with images must fit one row; shorten it, use fewer or smaller images (image_size_for_vit) or raise max_target_length"
      )
    count = sum(len(p) for p in tiles)
    if count > self.budget:
      raise DataError(
        f"{where} has {count} image patches ({', '.join('x'.join(map(str, g[1:])) for g in grids)} patches), more than the "
        f"max_patches_per_row_for_vit={self.budget} a row holds; raise max_patches_per_row_for_vit or lower image_size_for_vit"
      )
    doc["mask"] = np.where(tokens == self.spec.image_token_id, 0, doc["mask"]).astype(np.int32)  # placeholders are never targets
    t = self.spec.tower
    doc[PATCH_KEY] = np.concatenate(tiles) if tiles else np.zeros((0, t.num_channels * t.patch_size**2), np.uint8)
    marks = np.zeros((count, 3), np.int32)
    first = 0
    for grid, patches in zip(grids, tiles):
      marks[first] = grid
      first += len(patches)
    doc[GRID_KEY] = marks
    return doc


class RowImages:
  """grain map: a padded or packed row with its documents' PATCH_KEY and GRID_KEY -> the row with the tower's inputs
  (PATCH_KEY padded to the budget, the LAYOUT_KEYS of its GridLayout) and ROPE_KEY, each token's MRoPE position."""

  def __init__(self, spec: Qwen3VLEncoderSpec, budget: int):
    self.spec, self.budget = spec, budget

  def __call__(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    patches, marks = row.pop(PATCH_KEY), row.pop(GRID_KEY)
    grids = [(int(t), int(h), int(w)) for t, h, w in marks if t > 0]
    segments = row["inputs_segmentation"]
    starts = [0, *(int(i) for i in np.flatnonzero((segments[1:] != segments[:-1]) & (segments[1:] != 0)) + 1)]
    row[ROPE_KEY] = rope_index(row["inputs"], grids, self.spec.image_token_id, self.spec.merge_size, starts)[0]
    row[PATCH_KEY] = np.pad(patches, ((0, self.budget - len(patches)), (0, 0)))
    layout: GridLayout = layout_padded(grids, self.spec.tower, self.budget)
    for field, key in LAYOUT_KEYS.items():
      row[key] = getattr(layout, field)
    return row
