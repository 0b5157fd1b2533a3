"""Image preprocessing for Gemma 3's SigLIP tower, as Hugging Face's Gemma3ImageProcessor does it without pan-and-scan.

An RGB image u [h, w, 3] of uint8 (any size) becomes normalised pixels x [S, S, 3] (S = image_size):

    r = PIL bilinear resize of u to S x S       (uint8; the processor's resample=BILINEAR, PIL's antialiased filter)
    x = (r / 255 - mean) / std                  mean = std = 0.5 per channel, so x lies in [-1, 1]

Images are HWC here, as the tower takes them (the processor returns CHW).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

GEMMA3_MEAN = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN
GEMMA3_STD = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_STD
RESCALE = 1 / 255


def resize_bilinear(image: np.ndarray, size: int) -> np.ndarray:
  """uint8 [h, w, C] -> uint8 [size, size, C] by PIL's bilinear filter (what the processor's PIL path calls)."""
  if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
    raise ValueError(f"expected an RGB image as uint8 [height, width, 3], got {image.dtype} {image.shape}")
  return np.asarray(Image.fromarray(image).resize((size, size), resample=Image.Resampling.BILINEAR))


def normalise(image: np.ndarray, mean: Sequence[float] = GEMMA3_MEAN, std: Sequence[float] = GEMMA3_STD) -> np.ndarray:
  """uint8 [..., C] -> float32 (x / 255 - mean) / std: rescaled in float64 and cast, then normalised in float32 (as the processor)."""
  scaled = (image.astype(np.float64) * RESCALE).astype(np.float32)
  return ((scaled - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).astype(np.float32)


def gemma3_pixels(images: Sequence[np.ndarray], image_size: int) -> np.ndarray:
  """RGB uint8 images [h_i, w_i, 3] of any sizes -> float32 [N, image_size, image_size, 3], the tower's input."""
  return np.stack([normalise(resize_bilinear(np.asarray(image), image_size)) for image in images])


QWEN3_VL_MEAN = (0.5, 0.5, 0.5)  # Qwen3-VL's preprocessor_config.json (the processor class defaults to CLIP's)
QWEN3_VL_STD = (0.5, 0.5, 0.5)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
  """The size Qwen's processor resizes to: sides rounded to multiples of factor (= patch x merge), the area brought
  within [min_pixels, max_pixels] keeping the aspect ratio."""
  if max(height, width) / min(height, width) > 200:
    raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
  h, w = round(height / factor) * factor, round(width / factor) * factor
  if h * w > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
  elif h * w < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
  return h, w


def qwen3_vl_image_patches(image: np.ndarray, *, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int) -> tuple[np.ndarray, tuple[int, int, int]]:
  """One RGB uint8 image -> (its resized pixels cut into patches, uint8 [h w, C, p, p] in spatial-merge-block order
  (m x m neighbours consecutive), its grid (1, h, w)): resized (PIL bicubic) to smart_resize's size, not yet normalised."""
  image = np.asarray(image)
  if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
    raise ValueError(f"expected an RGB image as uint8 [height, width, 3], got {image.dtype} {image.shape}")
  height, width = smart_resize(image.shape[0], image.shape[1], patch_size * merge_size, min_pixels, max_pixels)
  resized = np.asarray(Image.fromarray(image).resize((width, height), resample=Image.Resampling.BICUBIC)).transpose(2, 0, 1)  # [C, H, W]
  gh, gw, m, p = height // patch_size, width // patch_size, merge_size, patch_size
  tiles = resized.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
  return np.ascontiguousarray(tiles.reshape(gh * gw, 3, p, p)), (1, gh, gw)


def qwen3_vl_normalise_table(mean: Sequence[float] = QWEN3_VL_MEAN, std: Sequence[float] = QWEN3_VL_STD) -> np.ndarray:
  """float32 [C, 256]: channel c's normalised value of each uint8 pixel value (what `normalise` gives)."""
  values = np.repeat(np.arange(256, dtype=np.uint8)[:, None], len(mean), axis=1)
  return np.ascontiguousarray(normalise(values, mean, std).T)


def qwen3_vl_patches(
  images: Sequence[np.ndarray],
  *,
  patch_size: int = 16,
  temporal_patch_size: int = 2,
  merge_size: int = 2,
  min_pixels: int = 56 * 56,
  max_pixels: int = 28 * 28 * 1280,
  mean: Sequence[float] = QWEN3_VL_MEAN,
  std: Sequence[float] = QWEN3_VL_STD,
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
  """RGB uint8 images of any sizes -> (packed patches [L, 3 T p p] float32, grids [(1, h, w)]), as Qwen2VLImageProcessor.

  Each image is resized (PIL bicubic) to smart_resize's size, rescaled and normalised, cut into p x p patches listed
  in spatial-merge-block order (m x m neighbours consecutive), each repeated over the T temporal slots; rows are
  (C, T, p, p) flattened. The grids are what Qwen3VLVisionTower's layout (qwen3_vl.grid_layout) takes.
  """
  all_patches, grids = [], []
  for image in images:
    tiles, grid = qwen3_vl_image_patches(image, patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels, max_pixels=max_pixels)
    pixels = normalise(tiles.transpose(0, 2, 3, 1), mean, std).transpose(0, 3, 1, 2)  # [n, C, p, p]
    pixels = np.broadcast_to(pixels[:, :, None], (pixels.shape[0], 3, temporal_patch_size, patch_size, patch_size))
    all_patches.append(pixels.reshape(pixels.shape[0], -1))
    grids.append(grid)
  return np.concatenate(all_patches).astype(np.float32), grids
