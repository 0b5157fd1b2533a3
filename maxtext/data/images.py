"""Images on the host: reading them (bytes, base64 or a path), checking them against the token ids whose placeholders
they fill, and preprocessing them to the vision tower's pixels (maxtext.vision.preprocess). Every problem a user's
data can cause is a one-line DataError naming the example."""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from maxtext.errors import DataError
from maxtext.vision import preprocess

MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485  # PIL's decompression-bomb bound: a larger image is refused unread


def read_image(source: str | bytes, base_dir: Path | None, where: str) -> np.ndarray:
  """An image as RGB uint8 [h, w, 3] from raw bytes, a data URI ('data:image/png;base64,...') or a path (relative
  to base_dir). Unreadable, missing or over MAX_IMAGE_PIXELS: a DataError naming `where`."""
  if isinstance(source, str):
    data = _base64(source)
    if data is None:
      path = Path(source) if base_dir is None or Path(source).is_absolute() else base_dir / source
      try:
        data = path.read_bytes()
      except OSError as e:
        raise DataError(f"{where}: image '{source}' cannot be read ({e.strerror or e}); give base64 bytes or a path relative to the data file") from None
  else:
    data = bytes(source)
  try:
    with Image.open(io.BytesIO(data)) as image:
      if image.width * image.height > MAX_IMAGE_PIXELS:
        raise DataError(f"{where}: the image is {image.width} x {image.height} pixels, more than the {MAX_IMAGE_PIXELS} an image may have; downscale it first")
      return np.asarray(image.convert("RGB"))
  except DataError:
    raise
  except Exception as e:  # PIL raises many types for a damaged or unknown file
    raise DataError(f"{where}: the image is not a readable PNG/JPEG/... file ({type(e).__name__}); fix or drop it") from None


def _base64(text: str) -> bytes | None:
  """The bytes of a data URI ('data:image/png;base64,...'); None for any other string (a path)."""
  if not text.startswith("data:"):
    return None
  try:
    return base64.b64decode(text.split(",", 1)[-1], validate=True)
  except (binascii.Error, ValueError):
    return b""  # not base64: PIL then reports an unreadable image


def placeholder_runs(tokens: Sequence[int], image_token_id: int) -> list[int]:
  """The lengths of the runs of image_token_id in tokens, in order."""
  runs, count = [], 0
  for t in tokens:
    if t == image_token_id:
      count += 1
    elif count:
      runs.append(count)
      count = 0
  return runs + [count] if count else runs


def check_placeholders(tokens: Sequence[int], images: int, image_token_id: int, tokens_per_image: int, where: str) -> None:
  """tokens must hold exactly `images` runs of tokens_per_image placeholders: else a one-line DataError."""
  runs = placeholder_runs(tokens, image_token_id)
  if len(runs) != images:
    raise DataError(f"{where} has {len(runs)} image place(s) but {images} image(s); give one image per <image> place")
  if any(r != tokens_per_image for r in runs):
    raise DataError(
      f"{where}: an image place holds {min(r for r in runs if r != tokens_per_image)} placeholder tokens, not mm_tokens_per_image={tokens_per_image}"
    )


def pixels_of(images: Sequence[np.ndarray], image_size: int, where: str) -> np.ndarray:
  """RGB uint8 images of any sizes -> the tower's pixels [N, image_size, image_size, 3] float32 (a DataError if one is not RGB uint8)."""
  for image in images:
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
      raise DataError(f"{where}: an image is {image.dtype} {image.shape}; images are RGB uint8 [height, width, 3]")
  return preprocess.gemma3_pixels(images, image_size)
