"""Image preprocessing for Llama 4's tile encoder, as Hugging Face's Llama4ImageProcessor does it, and the placeholder
text of an image (Llama4Processor's).

An RGB image u [h, w, 3] of uint8 becomes tiles [n, S, S, 3] (S = tile_size):

    canvas = the (a S) x (b S) grid, a b <= max_tiles, that needs the least upscaling (or, when none fits, the least
             downscaling) to hold the image undistorted; among equals the smallest area
    r      = u resized undistorted to fit min(canvas, max(image side, S)) per side (bilinear, antialiased), padded with
             zeros right and below to the canvas
    tiles  = r cut into a x b tiles row-major, then, when a b > 1, u resized (distorted) to one S x S global tile
    x      = ((tile in bfloat16) x 1/255 - 0.5) / 0.5, each step rounded to bfloat16 (the processor's arithmetic)

The resize is the antialiased bilinear filter in fixed point, as torch's uint8 interpolation computes it (what the
processor's torchvision resize runs on CPUs with AVX2): bit-exact with it. Tiles are HWC here (the processor's are CHW).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

LLAMA4_MEAN = (0.5, 0.5, 0.5)
LLAMA4_STD = (0.5, 0.5, 0.5)
MAX_TILES = 16  # the processor's max_patches (max_num_tiles_for_vit)
# Llama4Processor's tokens around an image's placeholders (the placeholder itself is image_token_id, <|patch|>)
IMAGE_START, IMAGE_END, IMAGE_MARK = "<|image_start|>", "<|image_end|>", "<|image|>"
TILE_X_SEPARATOR, TILE_Y_SEPARATOR = "<|tile_x_separator|>", "<|tile_y_separator|>"
MARKERS = (IMAGE_START, IMAGE_END, IMAGE_MARK, TILE_X_SEPARATOR, TILE_Y_SEPARATOR)


def supported_canvases(max_tiles: int, tile: int) -> list[tuple[int, int]]:
  """Every (height, width) of a x b tiles with a b <= max_tiles, in the processor's order (by aspect ratio as first
  met, counting down from max_tiles tiles)."""
  by_ratio: dict[float, list[tuple[int, int]]] = {}
  for count in range(max_tiles, 0, -1):
    for a in sorted(d for d in range(1, count + 1) if count % d == 0):
      by_ratio.setdefault(a / (count // a), []).append((a, count // a))
  return [(a * tile, b * tile) for grids in by_ratio.values() for a, b in grids]


def best_canvas(height: int, width: int, canvases: Sequence[tuple[int, int]]) -> tuple[int, int]:
  """The canvas the image fits undistorted with the smallest upscale (>= 1), else the largest downscale; among equal
  scales the smallest area (the first such)."""
  scales = [np.float32(min(np.float32(ch) / np.float32(height), np.float32(cw) / np.float32(width))) for ch, cw in canvases]
  up = [s for s in scales if s >= 1]
  chosen = min(up) if up else max(scales)
  candidates = [c for c, s in zip(canvases, scales) if s == chosen]
  return min(candidates, key=lambda c: c[0] * c[1])


def undistorted_size(height: int, width: int, target_height: int, target_width: int) -> tuple[int, int]:
  """The largest size within the target keeping the aspect ratio (the processor's get_max_res_without_distortion)."""
  scale_w, scale_h = target_width / width, target_height / height
  if scale_w < scale_h:
    return max(1, min(math.floor(height * scale_w), target_height)), max(1, target_width)
  return max(1, target_height), max(1, min(math.floor(width * scale_h), target_width))


def _resample_matrix(in_size: int, out_size: int) -> tuple[np.ndarray, int]:
  """(integer weights [out, in], their fixed-point bits) of the antialiased bilinear filter along one axis.

  Output i is centred at s (i + 1/2), s = in / out, and weighs the inputs within max(s, 1) of it by the triangle
  1 - |d| / max(s, 1), normalised to sum 1; the weights are then rounded to integers of the most bits (< 22) that keep
  the largest one below 2^15, as torch's uint8 path (what transformers' torchvision resize runs) does."""
  scale = in_size / out_size
  support = max(scale, 1.0)
  dense = np.zeros((out_size, in_size))
  for i in range(out_size):
    center = scale * (i + 0.5)
    first = max(int(center - support + 0.5), 0)
    last = min(int(center + support + 0.5), in_size)
    taps = np.maximum(0.0, 1.0 - np.abs((np.arange(first, last) - center + 0.5) / support))
    dense[i, first:last] = taps / taps.sum() if taps.sum() else taps
  bits = 0
  while bits < 22 and int(0.5 + dense.max() * (1 << (bits + 1))) < (1 << 15):
    bits += 1
  return np.floor(dense * (1 << bits) + 0.5).astype(np.int64), bits


def _resample(image: np.ndarray, axis: int, size: int) -> np.ndarray:
  weights, bits = _resample_matrix(image.shape[axis], size)
  summed = np.tensordot(weights, np.moveaxis(image.astype(np.int64), axis, 0), axes=(1, 0)) + (1 << (bits - 1))
  return np.moveaxis(np.clip(summed >> bits, 0, 255).astype(np.uint8), 0, axis)


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """uint8 [h, w, C] -> uint8 [height, width, C]: antialiased bilinear, the width first, each pass rounded to uint8."""
  if width != image.shape[1]:
    image = _resample(image, 1, width)
  if height != image.shape[0]:
    image = _resample(image, 0, height)
  return image


def normalise_bf16(pixels: np.ndarray) -> np.ndarray:
  """uint8 -> float32 of the processor's bfloat16 steps: x / 255 (x times the float32 1/255), - 0.5, / 0.5."""
  bf16 = ml_dtypes.bfloat16
  x = pixels.astype(np.float32).astype(bf16)
  x = (x.astype(np.float32) * np.float32(1 / 255)).astype(bf16)
  x = (x.astype(np.float32) - np.float32(LLAMA4_MEAN[0])).astype(bf16)
  return (x.astype(np.float32) / np.float32(LLAMA4_STD[0])).astype(bf16).astype(np.float32)


def llama4_tiles(image: np.ndarray, tile_size: int, max_tiles: int = MAX_TILES) -> tuple[np.ndarray, tuple[int, int]]:
  """One RGB uint8 image [h, w, 3] -> (normalised tiles [n, S, S, 3] float32, (rows, columns) of the local tiles);
  n = rows x columns, plus one global tile when that is above 1."""
  tiles, grid = llama4_tile_levels(image, tile_size, max_tiles)
  return normalise_bf16(tiles), grid


def pixel_table() -> np.ndarray:
  """float32 [256, 3]: normalise_bf16 of each uint8 level per channel (a training batch's tiles are uint8 until the step)."""
  return normalise_bf16(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1))


def llama4_tile_levels(image: np.ndarray, tile_size: int, max_tiles: int = MAX_TILES) -> tuple[np.ndarray, tuple[int, int]]:
  """llama4_tiles before normalising: (uint8 tiles [n, S, S, 3], (rows, columns))."""
  image = np.asarray(image)
  if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
    raise ValueError(f"expected an RGB image as uint8 [height, width, 3], got {image.dtype} {image.shape}")
  h, w = image.shape[:2]
  ch, cw = best_canvas(h, w, supported_canvases(max_tiles, tile_size))
  limit_h, limit_w = min(max(h, tile_size), ch), min(max(w, tile_size), cw)
  nh, nw = undistorted_size(h, w, limit_h, limit_w)
  canvas = np.zeros((ch, cw, 3), np.uint8)
  canvas[:nh, :nw] = resize(image, nh, nw)
  rows, cols = ch // tile_size, cw // tile_size
  tiles = canvas.reshape(rows, tile_size, cols, tile_size, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, tile_size, tile_size, 3)
  if rows * cols > 1:
    tiles = np.concatenate([tiles, resize(image, tile_size, tile_size)[None]])
  return tiles, (rows, cols)


def llama4_pixels(images: Sequence[np.ndarray], tile_size: int, max_tiles: int = MAX_TILES) -> tuple[np.ndarray, list[tuple[int, int]]]:
  """RGB uint8 images of any sizes -> (all their tiles [N, S, S, 3] in image order, each image's (rows, columns))."""
  out = [llama4_tiles(image, tile_size, max_tiles) for image in images]
  return np.concatenate([tiles for tiles, _ in out]), [grid for _, grid in out]


def image_text(grid: tuple[int, int], tokens_per_tile: int, patch: str = "<|patch|>") -> str:
  """The text that stands for one image of `grid` tiles in a prompt (Llama4Processor's): its local tiles' placeholders
  with tile separators, then the global tile's (a single tile is its own global tile)."""
  rows, cols = grid
  text = IMAGE_START
  if rows * cols > 1:
    for _ in range(rows):
      text += TILE_X_SEPARATOR.join([patch * tokens_per_tile] * cols) + TILE_Y_SEPARATOR
  return text + IMAGE_MARK + patch * tokens_per_tile + IMAGE_END


def prompt_tiles(config, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[np.ndarray]], rows: int) -> np.ndarray:
  """Each prompt's RGB uint8 images -> their tiles [rows, M, S, S, 3] in image order (M the most tiles any prompt has;
  unused slots zero). A prompt must hold tokens_per_image placeholder ids for each of its images' tiles (image_text
  gives an image's placeholder text): else a one-line DataError. config: a llama4 MaxTextConfig with use_multimodal."""
  from maxtext.errors import DataError
  from maxtext.models import vision_specs

  spec, max_tiles = vision_specs.vision(config), config.max_num_tiles_for_vit
  per_prompt = []
  for i, (prompt, row) in enumerate(zip(prompts, images)):
    for image in row:
      image = np.asarray(image)
      if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise DataError(f"prompt {i}: an image is {image.dtype} {image.shape}; images are RGB uint8 [height, width, 3]")
    tiles = llama4_pixels(list(row), spec.tile_size, max_tiles)[0] if row else np.zeros((0, spec.tile_size, spec.tile_size, 3), np.float32)
    placeholders = int(np.sum(np.asarray(prompt) == spec.image_token_id))
    if placeholders != len(tiles) * spec.tokens_per_image:
      raise DataError(
        f"prompt {i} holds {placeholders} image placeholder ids, but its {len(row)} image(s) make {len(tiles)} tile(s) of {spec.tokens_per_image}; "
        "put each image's placeholder text (llama4_preprocess.image_text) in the prompt"
      )
    per_prompt.append(tiles)
  out = np.zeros((rows, max(1, max(len(t) for t in per_prompt)), spec.tile_size, spec.tile_size, 3), np.float32)
  for i, tiles in enumerate(per_prompt):
    out[i, : len(tiles)] = tiles
  return out


def encode_prompt(config, tokenizer, text: str, images: Sequence[np.ndarray]) -> list[int]:
  """A decode prompt's ids with each image_placeholder replaced by its image's placeholder text (image_text, for the
  image's tile grid under max_num_tiles_for_vit): the marker tokens by the tokenizer's ids for them, each placeholder
  image_token_id. As many places as images, and a tokenizer that knows the markers: else a one-line DataError."""
  from maxtext.errors import DataError
  from maxtext.models import vision_specs

  parts = text.split(config.image_placeholder)
  if len(parts) - 1 != len(images):
    raise DataError(
      f"the prompt has {len(parts) - 1} '{config.image_placeholder}' place(s) but image_path gives {len(images)} image(s); give one image per place"
    )
  markers = {}
  for marker in MARKERS:
    ids = tokenizer.encode(marker)
    if len(ids) != 1:
      raise DataError(f"the tokenizer encodes Llama 4's image marker {marker} as {len(ids)} ids, not one; use the model's own tokenizer")
    markers[marker] = ids[0]
  spec = vision_specs.vision(config)
  out = tokenizer.encode(parts[0]) if parts[0] else []
  for image, part in zip(images, parts[1:]):
    grid = llama4_tiles(np.asarray(image), spec.tile_size, config.max_num_tiles_for_vit)[1]
    out += image_ids(grid, spec.tokens_per_image, spec.image_token_id, {m: [i] for m, i in markers.items()})
    out += tokenizer.encode(part) if part else []
  return out


def image_ids(grid: tuple[int, int], tokens_per_tile: int, image_token_id: int, marker_ids: dict[str, list[int]]) -> list[int]:
  """The ids of image_text(grid): each placeholder image_token_id, each marker its ids in marker_ids."""
  patch, out = "\0", []
  pieces, i = image_text(grid, tokens_per_tile, patch=patch), 0
  while i < len(pieces):
    if pieces[i] == patch:
      out.append(image_token_id)
      i += 1
      continue
    marker = next(m for m in marker_ids if pieces.startswith(m, i))
    out += marker_ids[marker]
    i += len(marker)
  return out
