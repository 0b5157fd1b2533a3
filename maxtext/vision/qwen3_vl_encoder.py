"""Qwen3-VL's images in the decoder's input: the vision tower per row, where its tokens go, the DeepStack features and
the multimodal rope (MRoPE) positions.

A row of token ids holds each image as a run of t h w / m^2 placeholder ids (HF image_token_id; m the spatial merge
size, (t, h, w) the image's patch grid). The host (`prepare`) turns each row's RGB images into the tower's packed
patches and per-patch layout, padded to one length for the batch, and computes every token's (t, h, w) rope position:

    text token        (p, p, p)                          p counts up from the document's start (or the last image)
    image token (r,c) (s, s + r, s + c)                  s: the position after the text before it; r, c its merged row/column
    after an image    p = s + max(h, w) / m              (HF Qwen3VLModel.get_rope_index)

On device the tower runs on each row's patches (`Qwen3VLVisionEncoder`): its merged tokens replace the row's
placeholders in order, and DeepStack feature j (a merger of tower block deepstack_indexes[j]) is added to the hidden
states at the same places after decoder layer j (`deepstack_add`). Packed rows give each document its own positions
(restarting at 0) and, as every image's patches attend only within their frame, the documents stay apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext.platform import Policy
from maxtext.vision import preprocess
from maxtext.vision.gemma3_encoder import merge
from maxtext.vision.qwen3_vl import GridLayout, Qwen3VLVisionSpec, Qwen3VLVisionTower, grid_layout
from maxtext.vision.siglip import Remat

PATCH_MULTIPLE = 64  # patch rows per batch row are padded to a multiple of this, so few lengths compile


@dataclasses.dataclass(frozen=True)
class Qwen3VLEncoderSpec:
  """The vision component of a Qwen3-VL model (maxtext.models.specs builds it from the *_for_vit keys)."""

  tower: Qwen3VLVisionSpec
  image_token_id: int  # the placeholder id each merged token replaces
  min_pixels: int  # preprocessing: the resized area's lower bound (Qwen's smart_resize)
  max_pixels: int  # and its upper bound: image_size_for_vit squared
  remat_policy: str = "none"  # remat_policy_for_vit

  @property
  def merge_size(self) -> int:
    return self.tower.spatial_merge_size

  @property
  def deepstack_layers(self) -> int:
    """How many first decoder layers receive a DeepStack feature."""
    return len(self.tower.deepstack_indexes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3VLImages:
  """A batch's images as the model takes them (a pytree; `prepare` builds it on the host).

  patches [B, L, C T p p]: each row's images' patches packed (padding rows zero); layout: their GridLayout, each array
  with a leading B (padding patches in frame -1); rope_positions [B, S, 3]: every token's (t, h, w) rope position."""

  patches: np.ndarray | jax.Array
  layout: GridLayout
  rope_positions: np.ndarray | jax.Array


class Qwen3VLVisionEncoder(nnx.Module):
  """encoder(images: Qwen3VLImages) -> (merged tokens [B, L / m^2, E_text], DeepStack features [n, B, L / m^2, E_text])."""

  def __init__(self, spec: Qwen3VLEncoderSpec, *, policy: Policy, rngs: nnx.Rngs):
    from maxtext.models import remat  # here: maxtext.models imports this module

    self.spec = spec
    wrap: Remat | None = None
    if spec.remat_policy != "none":

      def wrap(fn, name=spec.remat_policy):
        return remat.wrap(fn, name, prevent_cse=False)

    self.tower = Qwen3VLVisionTower(spec.tower, policy=policy, rngs=rngs, remat=wrap)

  def __call__(self, images: Qwen3VLImages) -> tuple[jax.Array, jax.Array]:
    graphdef, state = nnx.split(self.tower)

    def one_row(patches: jax.Array, layout: GridLayout) -> tuple[jax.Array, jax.Array]:
      return nnx.merge(graphdef, state)(patches, layout)

    layout = jax.tree.map(jnp.asarray, images.layout)
    tokens, deep = jax.vmap(one_row)(jnp.asarray(images.patches), layout)
    return tokens, jnp.moveaxis(deep, 1, 0)

  def embed(self, text: jax.Array, tokens: jax.Array, images: Qwen3VLImages) -> tuple[jax.Array, jax.Array]:
    """Embedded text [B, S, E] -> (the same with the merged tokens at the placeholders, DeepStack features placed
    [n, B, S, E], zero at text tokens)."""
    merged, deep = self(images)
    placeholder = self.spec.image_token_id
    x = merge(text, merged, tokens, placeholder)
    zeros = jnp.zeros_like(text)
    placed = jax.vmap(lambda d: merge(zeros, d, tokens, placeholder))(deep) if deep.shape[0] else jnp.zeros((0, *text.shape), text.dtype)
    return x, placed


def images_from_pixels(pixels: jax.Array, layout: GridLayout, rope_positions: jax.Array, spec: Qwen3VLEncoderSpec) -> Qwen3VLImages:
  """A training batch's images (maxtext.data.qwen3_vl_records): uint8 resized pixels [B, L, C p p] of the packed
  patches -> Qwen3VLImages, normalised as the processor does (a table of the 256 values per channel) and repeated
  over the T temporal slots."""
  t = spec.tower
  table = jnp.asarray(preprocess.qwen3_vl_normalise_table())  # [C, 256]
  b, length, _ = pixels.shape
  x = pixels.reshape(b, length, t.num_channels, t.patch_size**2).astype(jnp.int32)
  values = table[jnp.arange(t.num_channels)[:, None], x]  # [B, L, C, p p]
  values = jnp.broadcast_to(values[:, :, :, None], (b, length, t.num_channels, t.temporal_patch_size, t.patch_size**2))
  return Qwen3VLImages(values.reshape(b, length, -1), layout, rope_positions)


def deepstack_add(h: jax.Array, layer: int | jax.Array, placed: jax.Array) -> jax.Array:
  """The hidden states after decoder layer `layer` (an int or a traced index) plus its DeepStack feature, if any."""
  n = placed.shape[0]
  if isinstance(layer, int):
    return h + placed[layer].astype(h.dtype) if layer < n else h
  feature = placed[jnp.minimum(layer, n - 1)].astype(h.dtype)
  return jnp.where(layer < n, h + feature, h)


def patch_budget(spec: Qwen3VLEncoderSpec, max_patches: int) -> int:
  """Patches a training row holds: max_patches (max_patches_per_row_for_vit), or (0) the most one image of
  max_pixels has. A ValueError when it is not a multiple of m^2 (the merger groups m x m patches)."""
  group = spec.merge_size**2
  if max_patches == 0:
    factor = spec.tower.patch_size * spec.merge_size
    return max(1, spec.max_pixels // factor**2) * group
  if max_patches % group:
    raise ValueError(
      f"max_patches_per_row_for_vit={max_patches} is not a multiple of spatial_merge_size_for_vit^2={group}; use {max_patches - max_patches % group + group}"
    )
  return max_patches


def tokens_per_image(grid: tuple[int, int, int], merge_size: int) -> int:
  t, h, w = grid
  return t * h * w // merge_size**2


def image_tokens(image: np.ndarray, spec: Qwen3VLEncoderSpec) -> int:
  """The placeholder ids an RGB image [h, w, 3] takes in the text: its merged tokens after Qwen's resize."""
  t = spec.tower
  factor = t.patch_size * t.spatial_merge_size
  h, w = preprocess.smart_resize(int(image.shape[0]), int(image.shape[1]), factor, spec.min_pixels, spec.max_pixels)
  return (h // t.patch_size) * (w // t.patch_size) // t.spatial_merge_size**2


def rope_index(
  ids: Sequence[int], grids: Sequence[tuple[int, int, int]], image_token_id: int, merge_size: int, starts: Sequence[int] = (0,)
) -> tuple[np.ndarray, int]:
  """One row's token ids and its images' grids (in order) -> (int32 [S, 3] rope positions, the last document's rope
  delta: its next position minus its length). starts: where each packed document begins (positions restart there).
  A run of placeholders holds whole images in order; a mismatch is a ValueError."""
  ids = np.asarray(ids)
  out = np.zeros((len(ids), 3), np.int32)
  bounds = [*sorted(set(starts) | {0}), len(ids)]
  pending = list(grids)
  delta = 0
  for begin, end in zip(bounds[:-1], bounds[1:]):
    i, pos = begin, 0
    while i < end:
      if ids[i] != image_token_id:
        out[i] = pos
        i, pos = i + 1, pos + 1
        continue
      if not pending:
        raise ValueError(f"more image placeholders than images (at token {i})")
      t, h, w = pending.pop(0)
      gh, gw = h // merge_size, w // merge_size
      n = t * gh * gw
      if i + n > end or not np.all(ids[i : i + n] == image_token_id):
        raise ValueError(f"an image of grid {(t, h, w)} needs {n} placeholders in a row at token {i}")
      tt, rr, cc = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
      out[i : i + n] = np.stack([tt.reshape(-1) + pos, rr.reshape(-1) + pos, cc.reshape(-1) + pos], -1)
      i, pos = i + n, pos + max(gh, gw)
    delta = pos - (end - begin)
  if pending:
    raise ValueError(f"{len(pending)} image(s) left without placeholders")
  return out, delta


def layout_padded(grids: Sequence[tuple[int, int, int]], spec: Qwen3VLVisionSpec, length: int) -> GridLayout:
  """grid_layout of these grids padded to `length` patches: padding patches sit in frame -1 with zero position weights."""
  n = sum(t * h * w for t, h, w in grids)
  if grids:
    lay = grid_layout(grids, spec)
  else:
    lay = GridLayout(np.zeros((0, 2), np.int32), np.zeros((0, 4), np.int32), np.zeros((0, 4), np.float32), np.zeros((0,), np.int32))
  pad = length - n
  return GridLayout(
    np.concatenate([lay.rows_cols, np.zeros((pad, 2), np.int32)]),
    np.concatenate([lay.taps, np.zeros((pad, 4), np.int32)]),
    np.concatenate([lay.weights, np.zeros((pad, 4), np.float32)]),
    np.concatenate([lay.segments, np.full((pad,), -1, np.int32)]),
  )


def row_patches(images: Sequence[np.ndarray], spec: Qwen3VLEncoderSpec) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
  """One row's RGB uint8 images -> (packed patches [L, C T p p], grids), preprocessed as Qwen's image processor."""
  t = spec.tower
  if not images:
    return np.zeros((0, t.num_channels * t.temporal_patch_size * t.patch_size**2), np.float32), []
  return preprocess.qwen3_vl_patches(
    images,
    patch_size=t.patch_size,
    temporal_patch_size=t.temporal_patch_size,
    merge_size=t.spatial_merge_size,
    min_pixels=spec.min_pixels,
    max_pixels=spec.max_pixels,
  )


def prepare(
  rows: Sequence[Sequence[int]],
  images: Sequence[Sequence[np.ndarray]],
  spec: Qwen3VLEncoderSpec,
  starts: Sequence[Sequence[int]] | None = None,
  patch_rows: int | None = None,
) -> tuple[Qwen3VLImages, list[int]]:
  """Token-id rows (all of one length) and each row's RGB uint8 images -> (Qwen3VLImages, each row's rope delta).
  starts: per row, where its packed documents begin. patch_rows: the patch length to pad to (default: the longest
  row's, rounded up to PATCH_MULTIPLE). Placeholders that do not fit the images are a ValueError."""
  per_row = [row_patches(list(row_images), spec) for row_images in images]
  longest = max((p.shape[0] for p, _ in per_row), default=0)
  length = patch_rows if patch_rows is not None else max(PATCH_MULTIPLE, -(-longest // PATCH_MULTIPLE) * PATCH_MULTIPLE)
  if longest > length:
    raise ValueError(f"a row's images have {longest} patches, more than the {length} it may hold")
  patches, layouts, positions, deltas = [], [], [], []
  for b, (row, (p, grids)) in enumerate(zip(rows, per_row)):
    pos, delta = rope_index(row, grids, spec.image_token_id, spec.merge_size, starts[b] if starts is not None else (0,))
    patches.append(np.concatenate([p, np.zeros((length - p.shape[0], p.shape[1]), np.float32)]))
    layouts.append(layout_padded(grids, spec.tower, length))
    positions.append(pos)
    deltas.append(delta)
  layout = GridLayout(*(np.stack([getattr(lay, f.name) for lay in layouts]) for f in dataclasses.fields(GridLayout)))
  return Qwen3VLImages(np.stack(patches), layout, np.stack(positions)), deltas


def empty_batch(rows: int, width: int, images: Sequence[np.ndarray], spec: Qwen3VLEncoderSpec) -> Qwen3VLImages:
  """Zero-filled Qwen3VLImages of the shapes `prepare` gives rows of `width` tokens, each with these images (what a
  compile ahead of the real call takes)."""
  t = spec.tower
  patches = sum(image_tokens(im, spec) * t.spatial_merge_size**2 for im in images)
  length = max(PATCH_MULTIPLE, -(-patches // PATCH_MULTIPLE) * PATCH_MULTIPLE)
  layout = layout_padded([], t, length)
  layout = GridLayout(*(np.stack([getattr(layout, f.name)] * rows) for f in dataclasses.fields(GridLayout)))
  depth = t.num_channels * t.temporal_patch_size * t.patch_size**2
  return Qwen3VLImages(np.zeros((rows, length, depth), np.float32), layout, np.zeros((rows, width, 3), np.int32))
