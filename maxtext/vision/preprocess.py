"""Image preprocessing for Gemma 3's SigLIP tower, as Hugging Face's Gemma3ImageProcessor does it without pan-and-scan.

An RGB image u [h, w, 3] of uint8 (any size) becomes normalised pixels x [S, S, 3] (S = image_size):

    r = PIL bilinear resize of u to S x S       (uint8; the processor's resample=BILINEAR, PIL's antialiased filter)
    x = (r / 255 - mean) / std                  mean = std = 0.5 per channel, so x lies in [-1, 1]

Images are HWC here, as the tower takes them (the processor returns CHW).
"""

from __future__ import annotations

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
