"""Llama 4's vision component: the tile encoder (unfold patch embedding, class token, 2-D rope, pre-LN blocks, pixel
shuffle and the vision adapter MLP) and the multimodal projector, as one component beside the text decoder.

Each image arrives as tiles of S x S pixels (maxtext.vision.llama4_preprocess: the image's tiles, then a global tile
when there are several). A tile x [S, S, C] becomes T = P r^2 soft tokens of the text's width, with P = (S / p)^2
patches and r = pixel_shuffle_ratio:

    h_0  = [tiles(x) . W_patch ; cls] + pos            [P + 1, E]   the p x p unfold as a dense (no bias); the class
                                                                   token is appended last; learned positions
    h_0  = LN_pre(h_0)
    h_l  = h_{l-1} + Attn(LN_1 h_{l-1})                 bidirectional; q, k rotated by the 2-D rope (below)
    h_l  = h_l + W_2 gelu(W_1 LN_2 h_l)                 biases; gelu exact (erf)
    f    = LN_post(h_L) without the class token         [P, E]
    g    = pixel_shuffle(f, r)                          [P r^2, E / r^2]: each r^-1 x r^-1 block of patches in one token
    a    = gelu(W_b gelu(W_a g))                         [P r^2, A]  the vision adapter (no biases)
    soft = a . W_proj                                   [P r^2, E_text]  the multimodal projector (no bias)

The 2-D rope rotates neighbouring feature pairs (2i, 2i + 1) of each head (D = E / heads): pair i < D / 4 by
(column + 1) w_i, pair D / 4 + i by (row + 1) w_i, w_i = theta^(-4i / D); the class token is not rotated.

The blocks are stacked on `vision_layers` and scanned, each wrapped by remat_policy_for_vit; norms and the softmax run in
float32, matmuls in the policy's compute dtype. Parameters: `vision/tower/...` (all of the above but the projector; what
freeze_vision_encoder_params freezes) and `vision/projector/...`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.sharding import Rules, constrain
from maxtext.platform import Policy
from maxtext.vision.siglip import ACTIVATION, LayerNorm, Remat, SiglipAttention, SiglipBlock, SiglipMLP, patchify
from maxtext.vision.siglip import stacked_blocks as siglip_stacked_blocks


@dataclasses.dataclass(frozen=True)
class Llama4VisionSpec:
  """The numbers Llama 4's vision component reads (Hugging Face Llama4VisionConfig's names in comments)."""

  tile_size: int  # image_size: the tiles' side in pixels (tile_size_for_vit)
  patch_size: int  # patch_size
  emb_dim: int  # hidden_size
  mlp_dim: int  # intermediate_size
  num_layers: int  # num_hidden_layers
  num_heads: int  # num_attention_heads
  adapter_dim: int  # projector_input_dim = projector_output_dim = vision_output_dim: the adapter MLP's width
  text_dim: int  # text_config.hidden_size
  image_token_id: int  # image_token_index: the placeholder id (<|patch|>) each soft token replaces
  pixel_shuffle_ratio: float = 0.5  # pixel_shuffle_ratio
  rope_theta: float = 10000.0  # rope_parameters["rope_theta"]
  layer_norm_eps: float = 1e-5  # torch LayerNorm's default (the modules ignore norm_eps)
  num_channels: int = 3  # num_channels
  remat_policy: str = "none"  # remat_policy_for_vit
  rules: Rules = ()  # logical_axis_rules

  def __post_init__(self):
    if self.tile_size % self.patch_size:
      raise ValueError(f"tile_size {self.tile_size} is not a multiple of patch_size {self.patch_size}")
    if self.emb_dim % self.num_heads or self.head_dim % 4:
      raise ValueError(f"hidden size {self.emb_dim} over {self.num_heads} heads must give a head width that is a multiple of 4 (the 2-D rope's pairs)")
    side = self.patches_per_side * self.pixel_shuffle_ratio
    if not 0 < self.pixel_shuffle_ratio <= 1 or side != int(side) or (self.emb_dim / self.pixel_shuffle_ratio**2) != self.shuffled_dim:
      raise ValueError(f"pixel_shuffle_ratio {self.pixel_shuffle_ratio} must divide the {self.patches_per_side} patches per side and the width {self.emb_dim}")

  @property
  def patches_per_side(self) -> int:
    return self.tile_size // self.patch_size

  @property
  def num_patches(self) -> int:
    return self.patches_per_side**2

  @property
  def head_dim(self) -> int:
    return self.emb_dim // self.num_heads

  @property
  def shuffled_dim(self) -> int:
    """The width of a token after the pixel shuffle, E / r^2 (Hugging Face's intermediate_size in the published models)."""
    return int(round(self.emb_dim / self.pixel_shuffle_ratio**2))

  @property
  def tokens_per_image(self) -> int:
    """Soft tokens per tile, P r^2 (144 for 336-pixel tiles in 14-pixel patches)."""
    return int(round(self.num_patches * self.pixel_shuffle_ratio**2))

  @property
  def image_size(self) -> int:
    return self.tile_size


def rope_angles(spec: Llama4VisionSpec) -> np.ndarray:
  """float32 [P + 1, D / 2]: the angle of each rotated pair per position (patches row-major, then the class token: 0)."""
  g, d = spec.patches_per_side, spec.head_dim
  quarter = d // 4
  freqs = (1.0 / (np.float32(spec.rope_theta) ** (np.arange(0, d // 2, 2, dtype=np.float32)[:quarter] / np.float32(d // 2)))).astype(np.float32)
  index = np.arange(g * g)
  cols, rows = (index % g + 1).astype(np.float32), (index // g + 1).astype(np.float32)
  angles = np.concatenate([cols[:, None] * freqs[None], rows[:, None] * freqs[None]], axis=1).astype(np.float32)
  return np.concatenate([angles, np.zeros((1, 2 * quarter), np.float32)])


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, N, H, D] with pairs (2i, 2i + 1) rotated by the angles' cos, sin [N, D / 2]; computed in float32."""
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  a, b = pairs[..., 0], pairs[..., 1]
  c, s = cos[None, :, None, :], sin[None, :, None, :]
  return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape).astype(x.dtype)


def pixel_shuffle(x: jax.Array, ratio: float) -> jax.Array:
  """[B, G*G, C] row-major patches -> [B, (G r)^2, C / r^2]: Hugging Face's pixel_shuffle (width folded into channels,
  transposed, height folded, transposed back)."""
  b, n, c = x.shape
  g = int(round(n**0.5))
  folded = int(round(g * ratio))
  y = x.reshape(b, g, folded, int(round(c / ratio)))  # [B, h, w r, C / r]
  y = y.transpose(0, 2, 1, 3).reshape(b, folded, folded, int(round(c / ratio**2)))  # [B, w r, h r, C / r^2]
  return y.transpose(0, 2, 1, 3).reshape(b, folded * folded, -1)


class Llama4VisionAttention(SiglipAttention):
  """SigLIP's bidirectional attention with biases, q and k rotated by the 2-D rope."""

  def rotate(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    angles = jnp.asarray(rope_angles(self.spec))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)


def gelu(x: jax.Array) -> jax.Array:
  """The exact (erf) gelu in float32, in x's dtype."""
  return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


class Llama4VisionMLP(SiglipMLP):
  """fc2(gelu(fc1(x))), both with biases, gelu exact."""

  approximate_gelu = False


class Llama4VisionBlock(SiglipBlock):
  """SigLIP's pre-LN block with Llama 4's attention and MLP."""

  Attention = Llama4VisionAttention
  MLP = Llama4VisionMLP


def stacked_blocks(spec: Llama4VisionSpec, policy: Policy, keys: jax.Array) -> Llama4VisionBlock:
  """One Llama4VisionBlock whose parameters have a leading axis `vision_layers`, one block per random key."""
  return siglip_stacked_blocks(spec, policy, keys, Llama4VisionBlock)


class Llama4VisionAdapter(nnx.Module):
  """gelu(fc2(gelu(fc1(x)))) over pixel-shuffled tokens, without biases (Hugging Face's Llama4VisionPixelShuffleMLP)."""

  def __init__(self, spec: Llama4VisionSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    kw = dict(dense_kwargs(policy, rngs), use_bias=False, quant=None)
    self.wa = DenseGeneral((spec.shuffled_dim,), (spec.adapter_dim,), (None, "mlp"), **kw)
    self.wb = DenseGeneral((spec.adapter_dim,), (spec.adapter_dim,), ("mlp", None), **kw)

  def __call__(self, features: jax.Array) -> jax.Array:
    return gelu(self.wb(gelu(self.wa(pixel_shuffle(features, self.spec.pixel_shuffle_ratio)))))


class Llama4VisionTower(nnx.Module):
  """tower(tiles [N, S, S, C] normalised pixels) -> adapter features [N, P r^2, adapter_dim]."""

  def __init__(self, spec: Llama4VisionSpec, *, policy: Policy, rngs: nnx.Rngs, remat: Remat | None = None):
    self.spec = spec
    self.policy = policy
    self.remat = remat
    p, c, e = spec.patch_size, spec.num_channels, spec.emb_dim
    self.patch_embed = DenseGeneral((c, p, p), (e,), (None, None, None, "embed"), **dict(dense_kwargs(policy, rngs), use_bias=False, quant=None))
    scale = e**-0.5
    self.class_embed = nnx.Param((scale * jax.random.normal(rngs.params(), (e,), jnp.float32)).astype(policy.dtypes.params), logical_axes=("embed",))
    self.position_embed = nnx.Param(
      (scale * jax.random.normal(rngs.params(), (spec.num_patches + 1, e), jnp.float32)).astype(policy.dtypes.params), logical_axes=(None, "embed")
    )
    norm = dict(dtype=policy.dtypes.compute, weight_dtype=policy.dtypes.params)
    self.pre_norm = LayerNorm(e, spec.layer_norm_eps, **norm)
    self.blocks = stacked_blocks(spec, policy, jax.random.split(rngs.params(), spec.num_layers))
    self.post_norm = LayerNorm(e, spec.layer_norm_eps, **norm)
    self.adapter = Llama4VisionAdapter(spec, policy=policy, rngs=rngs)

  def embed_patches(self, tiles: jax.Array) -> jax.Array:
    """[N, S, S, C] -> LN_pre([patches . W ; cls] + pos) [N, P + 1, E]."""
    spec = self.spec
    if tiles.shape[1:] != (spec.tile_size, spec.tile_size, spec.num_channels):
      raise ValueError(f"tiles of shape {tiles.shape[1:]}; the tower takes {(spec.tile_size, spec.tile_size, spec.num_channels)} (preprocessing tiles)")
    patches = patchify(tiles.astype(self.policy.dtypes.compute), spec.patch_size).transpose(0, 1, 4, 2, 3)  # [N, P, C, p, p]: unfold's order
    x = self.patch_embed(patches)
    cls = jnp.broadcast_to(self.class_embed[...].astype(x.dtype), (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([x, cls], axis=1) + self.position_embed[...].astype(x.dtype)
    return constrain(self.pre_norm(x), ACTIVATION, spec.rules)

  def __call__(self, tiles: jax.Array) -> jax.Array:
    x = self.embed_patches(tiles)
    graphdef, state = nnx.split(self.blocks)

    def body(h: jax.Array, block_state) -> tuple[jax.Array, None]:
      return nnx.merge(graphdef, block_state)(h), None

    if self.remat is not None:
      body = self.remat(body)
    x, _ = jax.lax.scan(body, x, state)
    return self.adapter(self.post_norm(x)[:, :-1])


class Llama4Projector(nnx.Module):
  """The multimodal projector: adapter features [..., adapter_dim] -> soft tokens [..., E_text] (no bias)."""

  def __init__(self, spec: Llama4VisionSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.projection = DenseGeneral((spec.adapter_dim,), (spec.text_dim,), (None, "embed"), **dict(dense_kwargs(policy, rngs), quant=None))

  def __call__(self, features: jax.Array) -> jax.Array:
    return constrain(self.projection(features), ("activation_batch", "activation_length", "activation_embed"), self.spec.rules)


class Llama4VisionEncoder(nnx.Module):
  """encoder(tiles [B, M, S, S, 3] normalised pixels, each row's tiles in placeholder order) -> soft tokens
  [B, M * tokens_per_image, E_text]."""

  def __init__(self, spec: Llama4VisionSpec, *, policy: Policy, rngs: nnx.Rngs):
    from maxtext.models import remat  # here: maxtext.models imports this module

    self.spec = spec
    wrap: Remat | None = None
    if spec.remat_policy != "none":

      def wrap(fn, name=spec.remat_policy):
        return remat.wrap(fn, name, prevent_cse=False)

    self.tower = Llama4VisionTower(spec, policy=policy, rngs=rngs, remat=wrap)
    self.projector = Llama4Projector(spec, policy=policy, rngs=rngs)

  def __call__(self, tiles: jax.Array) -> jax.Array:
    b, m = tiles.shape[:2]
    soft = self.projector(self.tower(tiles.reshape(b * m, *tiles.shape[2:])))
    return soft.reshape(b, m * soft.shape[1], soft.shape[2])
