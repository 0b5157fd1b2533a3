"""SigLIP vision tower (Gemma 3's image encoder): patch embedding, learned positions, pre-LN encoder blocks, final norm.

An image x [B, H, W, C] (H = W = image_size, normalised pixels) becomes P = (image_size / patch_size)^2 patch
features [B, P, E]:

    patches = x cut into p x p tiles, row-major       [B, P, p, p, C]
    h_0     = patches . W_patch + b_patch + pos        [B, P, E]     (the stride-p convolution, as a dense over tiles)
    h_l     = h_{l-1} + Attn(LN_1(h_{l-1}))            bidirectional multi-head attention, biases on q, k, v, o
    h_l     = h_l + W_2 gelu_tanh(W_1 LN_2(h_l))       [B, P, F] hidden
    out     = LN_post(h_L)                             [B, P, E]

The L encoder blocks are stacked on a leading axis and run by jax.lax.scan (flat compile time in depth), each block
wrapped by an optional remat function, as the decoder does it. Norms and the softmax run in float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.sharding import Rules, constrain
from maxtext.platform import Policy

VISION_LAYERS_AXIS = "vision_layers"  # the stacked blocks' leading logical axis (no mesh rule: replicated)
ACTIVATION = ("activation_batch", "activation_length", "activation_embed")
Remat = Callable[[Callable], Callable]


@dataclasses.dataclass(frozen=True)
class SiglipSpec:
  """The numbers a SigLIP tower reads (Hugging Face SiglipVisionConfig's names in comments)."""

  image_size: int  # image_size: square input side in pixels
  patch_size: int  # patch_size: side of the square tiles (the convolution's kernel and stride)
  emb_dim: int  # hidden_size
  mlp_dim: int  # intermediate_size
  num_layers: int  # num_hidden_layers
  num_heads: int  # num_attention_heads
  layer_norm_eps: float = 1e-6  # layer_norm_eps
  num_channels: int = 3  # num_channels
  rules: Rules = ()  # logical_axis_rules

  def __post_init__(self):
    if self.image_size % self.patch_size:
      raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
    if self.emb_dim % self.num_heads:
      raise ValueError(f"hidden size {self.emb_dim} is not a multiple of {self.num_heads} heads")

  @property
  def patches_per_side(self) -> int:
    return self.image_size // self.patch_size

  @property
  def num_patches(self) -> int:
    return self.patches_per_side**2

  @property
  def head_dim(self) -> int:
    return self.emb_dim // self.num_heads


class LayerNorm(nnx.Module):
  """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32; the result in `dtype`."""

  def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, weight_dtype: jnp.dtype, logical_axis: str = "norm"):
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((dim,), weight_dtype), logical_axes=(logical_axis,))
    self.bias = nnx.Param(jnp.zeros((dim,), weight_dtype), logical_axes=(logical_axis,))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centered = x32 - mean
    y = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
  """[B, H, W, C] -> [B, (H/p)(W/p), p, p, C]: the p x p tiles in row-major order (the convolution's output order)."""
  b, h, w, c = images.shape
  p = patch_size
  tiles = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return tiles.reshape(b, (h // p) * (w // p), p, p, c)


class SiglipAttention(nnx.Module):
  """Bidirectional multi-head self-attention with biases: softmax(q k^T / sqrt(D)) v over all patches of an image."""

  def __init__(self, spec: SiglipSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.policy = policy
    e, h, d = spec.emb_dim, spec.num_heads, spec.head_dim
    kw = dict(dense_kwargs(policy, rngs), use_bias=True, quant=None)
    self.query = DenseGeneral((e,), (h, d), ("embed", "heads", "head_dim"), **kw)
    self.key = DenseGeneral((e,), (h, d), ("embed", "heads", "head_dim"), **kw)
    self.value = DenseGeneral((e,), (h, d), ("embed", "heads", "head_dim"), **kw)
    self.out = DenseGeneral((h, d), (e,), ("heads", "head_dim", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [B, P, E] -> [B, P, E]."""
    rules = self.spec.rules
    heads = ("activation_batch", "activation_length", "activation_heads", None)
    q, k = self.rotate(checkpoint_name(self.query(x), "query_proj"), checkpoint_name(self.key(x), "key_proj"))
    q, k = constrain(q, heads, rules), constrain(k, heads, rules)
    v = constrain(checkpoint_name(self.value(x), "value_proj"), heads, rules)
    precision = self.policy.dtypes.precision
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision, preferred_element_type=jnp.float32) * self.spec.head_dim**-0.5
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=precision, preferred_element_type=jnp.float32).astype(q.dtype)
    ctx = checkpoint_name(constrain(ctx, heads, rules), "context")
    return checkpoint_name(self.out(ctx), "out_proj")

  def rotate(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q, k [B, P, H, D] before the scores: unrotated here (a tower with a positional rotation overrides this)."""
    return q, k


class SiglipMLP(nnx.Module):
  """fc2(gelu(fc1(x))), both with biases; gelu's tanh approximation unless `approximate_gelu` is False."""

  approximate_gelu = True

  def __init__(self, spec: SiglipSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    kw = dict(dense_kwargs(policy, rngs), use_bias=True, quant=None)
    self.wi = DenseGeneral((spec.emb_dim,), (spec.mlp_dim,), ("embed", "mlp"), **kw)
    self.wo = DenseGeneral((spec.mlp_dim,), (spec.emb_dim,), ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = checkpoint_name(self.wi(x), "mlpwi")
    h = jax.nn.gelu(h.astype(jnp.float32), approximate=self.approximate_gelu).astype(h.dtype)
    h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"), self.spec.rules)
    return checkpoint_name(self.wo(h), "mlpwo")


class SiglipBlock(nnx.Module):
  """One pre-LN encoder block: h + Attn(LN_1 h), then h + MLP(LN_2 h); a tower's own block names its Attention and MLP."""

  Attention: type[SiglipAttention] = SiglipAttention
  MLP: type[SiglipMLP] = SiglipMLP

  def __init__(self, spec: SiglipSpec, *, policy: Policy, rngs: nnx.Rngs):
    norm = dict(dtype=policy.dtypes.compute, weight_dtype=policy.dtypes.params)
    self.spec = spec
    self.pre_attention_norm = LayerNorm(spec.emb_dim, spec.layer_norm_eps, **norm)
    self.attention = self.Attention(spec, policy=policy, rngs=rngs)
    self.pre_mlp_norm = LayerNorm(spec.emb_dim, spec.layer_norm_eps, **norm)
    self.mlp = self.MLP(spec, policy=policy, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.pre_attention_norm(x))
    x = x + self.mlp(self.pre_mlp_norm(x))
    return constrain(x, ACTIVATION, self.spec.rules)


def _prepend_axis(variable: nnx.Variable, name: str) -> nnx.Variable:
  axes = variable.get_metadata().get("logical_axes") or (None,) * (variable[...].ndim - 1)
  return variable.replace(logical_axes=(name,) + tuple(axes))


def stacked_blocks(spec: SiglipSpec, policy: Policy, keys: jax.Array, block: type[SiglipBlock] = SiglipBlock) -> SiglipBlock:
  """One `block` whose parameters have a leading axis `vision_layers`, one block per random key."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: block(spec, policy=policy, rngs=nnx.Rngs(0))))
  state = jax.vmap(lambda k: nnx.state(block(spec, policy=policy, rngs=nnx.Rngs(k))))(keys)
  state = jax.tree.map(lambda v: _prepend_axis(v, VISION_LAYERS_AXIS), state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.merge(graphdef, state)


class SiglipVisionTower(nnx.Module):
  """tower(images [B, image_size, image_size, C] normalised pixels) -> patch features [B, num_patches, E].

  remat wraps each scanned block's function (carry, block weights) -> carry, e.g.
  functools.partial(maxtext.models.remat.wrap, name=config.remat_policy, prevent_cse=False); None: no remat.
  """

  def __init__(self, spec: SiglipSpec, *, policy: Policy, rngs: nnx.Rngs, remat: Remat | None = None):
    self.spec = spec
    self.policy = policy
    self.remat = remat
    p, c, e = spec.patch_size, spec.num_channels, spec.emb_dim
    kw = dict(dense_kwargs(policy, rngs), use_bias=True, quant=None)
    self.patch_embed = DenseGeneral((p, p, c), (e,), (None, None, None, "embed"), **kw)
    self.position_embed = nnx.Param(
      jax.random.normal(rngs.params(), (spec.num_patches, e), jnp.float32).astype(policy.dtypes.params), logical_axes=(None, "embed")
    )
    self.blocks = stacked_blocks(spec, policy, jax.random.split(rngs.params(), spec.num_layers))
    self.post_norm = LayerNorm(e, spec.layer_norm_eps, dtype=policy.dtypes.compute, weight_dtype=policy.dtypes.params)

  def embed_patches(self, images: jax.Array) -> jax.Array:
    """[B, H, W, C] -> h_0 [B, P, E]: tiles . W_patch + b_patch + learned positions."""
    spec = self.spec
    if images.shape[1:] != (spec.image_size, spec.image_size, spec.num_channels):
      raise ValueError(f"images of shape {images.shape[1:]}; the tower takes {(spec.image_size, spec.image_size, spec.num_channels)} (preprocess resizes)")
    x = self.patch_embed(patchify(images.astype(self.policy.dtypes.compute), spec.patch_size))
    x = x + self.position_embed[...].astype(x.dtype)
    return constrain(x, ACTIVATION, spec.rules)

  def __call__(self, images: jax.Array) -> jax.Array:
    x = self.embed_patches(images)
    graphdef, state = nnx.split(self.blocks)

    def body(h: jax.Array, block_state) -> tuple[jax.Array, None]:
      return nnx.merge(graphdef, block_state)(h), None

    if self.remat is not None:
      body = self.remat(body)
    x, _ = jax.lax.scan(body, x, state)
    return self.post_norm(x)
