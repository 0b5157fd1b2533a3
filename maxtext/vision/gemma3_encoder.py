"""Gemma 3's images in the decoder's input: the SigLIP tower and projector as one component, and where its soft
tokens go.

A row of token ids holds each image as a run of `mm_tokens_per_image` placeholder ids (HF's image_token_id). With
images [B, M, S, S, 3] (each row's images in order; unused slots are ignored) the k-th placeholder of row b takes
soft token k of the row's images laid end to end:

    soft   = projector(tower(images))                  [B, M, T, E]   -> [B, M T, E]
    x[b,i] = soft[b, rank(b, i)]   where tokens[b, i] == image_token_id, rank = placeholders before i in the row
    x[b,i] = embed(tokens[b, i])   elsewhere (Gemma's sqrt(E) scale applies to text embeddings only)

`image_ids` numbers each row's runs of placeholders 1, 2, ... (0 for text): attention lets the tokens of one image
see each other both ways (maxtext.layers.xla_attention.position_mask); text stays causal.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext.platform import Policy
from maxtext.vision import preprocess
from maxtext.vision.gemma3_projector import Gemma3Projector, Gemma3ProjectorSpec
from maxtext.vision.siglip import Remat, SiglipSpec, SiglipVisionTower


@dataclasses.dataclass(frozen=True)
class Gemma3VisionSpec:
  """The vision component of a multimodal Gemma 3 (maxtext.models.specs builds it from the *_for_vit keys)."""

  tower: SiglipSpec
  projector: Gemma3ProjectorSpec
  image_token_id: int  # the placeholder id each soft token replaces
  remat_policy: str = "none"  # remat_policy_for_vit: what each tower block saves for the backward pass

  @property
  def tokens_per_image(self) -> int:
    return self.projector.mm_tokens_per_image


class Gemma3VisionEncoder(nnx.Module):
  """encoder(images [B, M, S, S, 3] normalised pixels) -> soft tokens [B, M * mm_tokens_per_image, E_text]."""

  def __init__(self, spec: Gemma3VisionSpec, *, policy: Policy, rngs: nnx.Rngs):
    from maxtext.models import remat  # here: maxtext.models imports this module

    self.spec = spec
    wrap: Remat | None = None
    if spec.remat_policy != "none":

      def wrap(fn, name=spec.remat_policy):
        return remat.wrap(fn, name, prevent_cse=False)

    self.tower = SiglipVisionTower(spec.tower, policy=policy, rngs=rngs, remat=wrap)
    self.projector = Gemma3Projector(spec.projector, policy=policy, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    b, m = images.shape[:2]
    soft = self.projector(self.tower(images.reshape(b * m, *images.shape[2:])))
    return soft.reshape(b, m * soft.shape[1], soft.shape[2])


def image_ids(tokens: jax.Array, image_token_id: int) -> jax.Array:
  """tokens [B, S] -> int32 [B, S]: 1, 2, ... for each row's runs of placeholder ids in order, 0 for other tokens."""
  is_image = tokens == image_token_id
  previous = jnp.pad(is_image[:, :-1], ((0, 0), (1, 0)))
  starts = jnp.cumsum(is_image & ~previous, axis=1, dtype=jnp.int32)
  return jnp.where(is_image, starts, 0)


def merge(text: jax.Array, soft: jax.Array, tokens: jax.Array, image_token_id: int) -> jax.Array:
  """Embedded text [B, S, E] with each placeholder replaced by the row's next soft token from soft [B, N, E]."""
  is_image = tokens == image_token_id
  rank = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, soft.shape[1] - 1)
  placed = jnp.take_along_axis(soft, rank[..., None], axis=1).astype(text.dtype)
  return jnp.where(is_image[..., None], placed, text)


def pixel_table() -> np.ndarray:
  """float32 [256, 3]: the normalised value of each uint8 level per channel, as maxtext.vision.preprocess computes it (bit-exact)."""
  return preprocess.normalise(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1))


def images_from_tokens(chunks: jax.Array, tokens: jax.Array, spec: Gemma3VisionSpec) -> jax.Array:
  """Per-token uint8 image chunks [B, L, c] (maxtext.data.image_text: chunk k of a resized image on its k-th placeholder)
  -> normalised images [B, L // T, S, S, 3], each row's images in placeholder order (slots past its last image zero)."""
  levels = slot_levels(chunks, tokens, spec.image_token_id, spec.tokens_per_image, spec.tower.image_size)
  return jnp.asarray(pixel_table())[levels.astype(jnp.int32), jnp.arange(3)]


def slot_levels(chunks: jax.Array, tokens: jax.Array, image_token_id: int, tokens_per_slot: int, side: int) -> jax.Array:
  """Per-token uint8 chunks [B, L, c] -> each row's slots (images, or Llama 4's tiles) uint8 [B, L // T, S, S, 3] in
  placeholder order: slot j from the chunks of placeholders j T .. j T + T - 1 (slots past the last zero)."""
  b, length, c = chunks.shape
  t, s = tokens_per_slot, side
  m = max(1, length // t)
  is_image = tokens == image_token_id
  rank = jnp.where(is_image, jnp.cumsum(is_image, axis=1) - 1, m * t)  # non-placeholders land past the end: dropped
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, length))
  gathered = jnp.zeros((b, m * t, c), chunks.dtype).at[rows, rank].set(chunks, mode="drop")
  return gathered.reshape(b, m, t * c)[:, :, : s * s * 3].reshape(b, m, s, s, 3)
