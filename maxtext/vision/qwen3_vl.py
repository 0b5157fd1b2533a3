"""Qwen3-VL's vision transformer: temporal patch embedding, interpolated learned positions, 2-D rope, pre-LN blocks,
spatial merge, and the DeepStack features of intermediate blocks.

The patches of all images arrive packed, as Hugging Face's processor emits them: L rows of C T p p pixels, image i
holding t_i h_i w_i rows (its grid_thw) in spatial-merge-block order (m x m neighbours consecutive). `grid_layout`
turns the grids into per-patch arrays on the host, so one compiled tower serves any mix of sizes of the same L:

    h_0 = x . W_patch + b_patch + sum_k w_k pos[j_k]      the (T, p, p) stride convolution as a dense; pos is the
                                                           learned G x G table, resampled bilinearly (align_corners)
                                                           to each image's h x w grid (4 taps j_k, weights w_k)
    h_l = h_{l-1} + Attn(LN_1 h_{l-1})                     attention within each frame only; q, k rotated by the
                                                           2-D rope: D/4 frequencies of the row, D/4 of the column
    h_l = h_l + W_2 act(W_1 LN_2 h_l)
    merge(h) = W_b gelu(W_a norm(h grouped by m x m))      [L / m^2, out_dim]; the final merger normalises each
                                                           patch (E), the DeepStack mergers each group (E m^2)

The output is merge(h_depth) and, for each DeepStack index i, merge_i(h_{i+1}) (the decoder adds them to its first
hidden states). The blocks are stacked on `vision_layers` and scanned in runs between DeepStack indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.mlp import ACTIVATIONS, activation
from maxtext.layers.sharding import Rules, constrain
from maxtext.platform import Policy
from maxtext.vision.siglip import ACTIVATION, VISION_LAYERS_AXIS, LayerNorm, Remat, _prepend_axis

NORM_EPS = 1e-6  # every LayerNorm of the tower (fixed in Hugging Face's modules)


@dataclasses.dataclass(frozen=True)
class Qwen3VLVisionSpec:
  """The numbers the tower reads (Hugging Face Qwen3VLVisionConfig's names in comments)."""

  emb_dim: int  # hidden_size
  mlp_dim: int  # intermediate_size
  num_layers: int  # depth
  num_heads: int  # num_heads
  out_dim: int  # out_hidden_size: the text model's width
  patch_size: int = 16  # patch_size
  temporal_patch_size: int = 2  # temporal_patch_size
  spatial_merge_size: int = 2  # spatial_merge_size
  num_position_embeddings: int = 2304  # num_position_embeddings: a square G x G table
  deepstack_indexes: tuple[int, ...] = (8, 16, 24)  # deepstack_visual_indexes
  rope_theta: float = 10000.0  # rope_parameters["rope_theta"]
  mlp_activation: str = "gelu"  # hidden_act (gelu_pytorch_tanh: maxtext's "gelu" is the tanh form)
  num_channels: int = 3  # in_channels
  rules: Rules = ()  # logical_axis_rules

  def __post_init__(self):
    if self.mlp_activation not in ACTIVATIONS:
      raise ValueError(f"unknown mlp_activation {self.mlp_activation!r}; expected one of {sorted(ACTIVATIONS)}")
    if self.emb_dim % self.num_heads or (self.emb_dim // self.num_heads) % 4:
      raise ValueError(f"head size {self.emb_dim} / {self.num_heads} must be a multiple of 4 (two rotary axes)")
    if list(self.deepstack_indexes) != sorted(set(self.deepstack_indexes)) or any(not 0 <= i < self.num_layers for i in self.deepstack_indexes):
      raise ValueError(f"deepstack indexes {self.deepstack_indexes} must be increasing block indexes below {self.num_layers}")

  @property
  def head_dim(self) -> int:
    return self.emb_dim // self.num_heads

  @property
  def grid_side(self) -> int:
    return int(round(self.num_position_embeddings**0.5))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GridLayout:
  """Per-patch arrays for packed patches of images with grids [(t, h, w), ...] (`grid_layout` builds them on the host;
  a pytree, so a jitted step takes them as inputs and one compilation serves every mix of image sizes of one length)."""

  rows_cols: np.ndarray | jax.Array  # [L, 2] int32: each patch's row and column in its image
  taps: np.ndarray | jax.Array  # [L, 4] int32: the position-table entries each patch interpolates
  weights: np.ndarray | jax.Array  # [L, 4] float32: their bilinear weights
  segments: np.ndarray | jax.Array  # [L] int32: the frame each patch belongs to (attention stays within a frame)


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
  """Bilinear taps (floor, floor + 1, clamped) and weights into a side-long table for positions index of size (align_corners)."""
  src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
  floor = np.floor(src)
  offsets = np.arange(2)
  taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
  weights = np.maximum(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0).astype(np.float32)
  return taps, weights


def grid_layout(grids: Sequence[tuple[int, int, int]], spec: Qwen3VLVisionSpec) -> GridLayout:
  """The layout of packed patches for images (or videos) of grids (t, h, w), in spatial-merge-block order."""
  m, side = spec.spatial_merge_size, spec.grid_side
  rows, cols, heights, widths, segments = [], [], [], [], []
  frame = 0
  for t, h, w in grids:
    if h % m or w % m:
      raise ValueError(f"grid {h} x {w} is not a multiple of the spatial merge size {m}")
    r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = (h // m, m, w // m, m)
    r, c = r.reshape(block).transpose(0, 2, 1, 3).reshape(-1), c.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    rows.append(np.tile(r, t))
    cols.append(np.tile(c, t))
    heights.append(np.full(t * h * w, h))
    widths.append(np.full(t * h * w, w))
    segments.append(np.repeat(np.arange(frame, frame + t), h * w))
    frame += t
  row, col, height, width = (np.concatenate(a) for a in (rows, cols, heights, widths))
  h_taps, h_weights = _axis_taps(row, height, side)
  w_taps, w_weights = _axis_taps(col, width, side)
  taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
  weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
  return GridLayout(np.stack([row, col], -1).astype(np.int32), taps.astype(np.int32), weights, np.concatenate(segments).astype(np.int32))


def rotary_angles(rows_cols: jax.Array, head_dim: int, theta: float) -> jax.Array:
  """[L, 2] positions -> [L, D] angles: (row f, col f) repeated twice, f = theta^(-4i/D) for i < D/4 (rotate-half layout)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim // 2, 2, dtype=jnp.float32) / (head_dim // 2)))
  angles = rows_cols.astype(jnp.float32)[..., None] * inv_freq  # [L, 2, D/4]
  half = jnp.concatenate([angles[:, 0], angles[:, 1]], axis=-1)
  return jnp.concatenate([half, half], axis=-1)


def rotate(x: jax.Array, angles: jax.Array) -> jax.Array:
  """x [B, L, H, D] rotated by angles [L, D] (rotate-half pairs i, i + D/2), in float32."""
  x32 = x.astype(jnp.float32)
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  x1, x2 = jnp.split(x32, 2, axis=-1)
  return (x32 * cos + jnp.concatenate([-x2, x1], axis=-1) * sin).astype(x.dtype)


class Qwen3VLVisionAttention(nnx.Module):
  """Multi-head attention with a fused qkv projection, 2-D rope, and a mask keeping each frame to itself."""

  def __init__(self, spec: Qwen3VLVisionSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.policy = policy
    e, h, d = spec.emb_dim, spec.num_heads, spec.head_dim
    kw = dict(dense_kwargs(policy, rngs), use_bias=True, quant=None)
    self.qkv = DenseGeneral((e,), (3, h, d), ("embed", None, "heads", "head_dim"), **kw)
    self.out = DenseGeneral((h, d), (e,), ("heads", "head_dim", "embed"), **kw)

  def __call__(self, x: jax.Array, angles: jax.Array, same_frame: jax.Array) -> jax.Array:
    """x [B, L, E], angles [L, D], same_frame [L, L] bool -> [B, L, E]."""
    rules = self.spec.rules
    heads = ("activation_batch", "activation_length", "activation_heads", None)
    q, k, v = (constrain(t, heads, rules) for t in jnp.unstack(checkpoint_name(self.qkv(x), "qkv_proj"), axis=2))
    q, k = rotate(q, angles), rotate(k, angles)
    precision = self.policy.dtypes.precision
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision, preferred_element_type=jnp.float32) * self.spec.head_dim**-0.5
    logits = jnp.where(same_frame, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=precision, preferred_element_type=jnp.float32).astype(q.dtype)
    return checkpoint_name(self.out(checkpoint_name(constrain(ctx, heads, rules), "context")), "out_proj")


class Qwen3VLVisionBlock(nnx.Module):
  """h + Attn(LN_1 h), then h + W_2 act(W_1 LN_2 h)."""

  def __init__(self, spec: Qwen3VLVisionSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    norm = dict(dtype=policy.dtypes.compute, weight_dtype=policy.dtypes.params)
    kw = dict(dense_kwargs(policy, rngs), use_bias=True, quant=None)
    self.pre_attention_norm = LayerNorm(spec.emb_dim, NORM_EPS, **norm)
    self.attention = Qwen3VLVisionAttention(spec, policy=policy, rngs=rngs)
    self.pre_mlp_norm = LayerNorm(spec.emb_dim, NORM_EPS, **norm)
    self.wi = DenseGeneral((spec.emb_dim,), (spec.mlp_dim,), ("embed", "mlp"), **kw)
    self.wo = DenseGeneral((spec.mlp_dim,), (spec.emb_dim,), ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array, angles: jax.Array, same_frame: jax.Array) -> jax.Array:
    x = x + self.attention(self.pre_attention_norm(x), angles, same_frame)
    h = checkpoint_name(self.wi(self.pre_mlp_norm(x)), "mlpwi")
    h = activation(self.spec.mlp_activation)(h.astype(jnp.float32)).astype(h.dtype)
    h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"), self.spec.rules)
    return constrain(x + checkpoint_name(self.wo(h), "mlpwo"), ACTIVATION, self.spec.rules)


class PatchMerger(nnx.Module):
  """[B, L, E] -> [B, L / m^2, out_dim]: each m x m group of consecutive patches concatenated, W_b gelu(W_a .), after a
  LayerNorm of each patch (per_group=False, the final merger) or of each concatenated group (DeepStack's mergers)."""

  def __init__(self, spec: Qwen3VLVisionSpec, per_group: bool, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.per_group = per_group
    wide = spec.emb_dim * spec.spatial_merge_size**2
    kw = dict(dense_kwargs(policy, rngs), use_bias=True, quant=None)
    self.norm = LayerNorm(wide if per_group else spec.emb_dim, NORM_EPS, dtype=policy.dtypes.compute, weight_dtype=policy.dtypes.params)
    self.wa = DenseGeneral((wide,), (wide,), (None, "mlp"), **kw)
    self.wb = DenseGeneral((wide,), (spec.out_dim,), ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, length, e = x.shape
    group = self.spec.spatial_merge_size**2
    if self.per_group:
      x = self.norm(x.reshape(b, length // group, group * e))
    else:
      x = self.norm(x).reshape(b, length // group, group * e)
    h = self.wa(x)
    h = jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(h.dtype)
    return self.wb(h)


def _stacked(cls, n: int, policy: Policy, keys: jax.Array, *args) -> nnx.Module:
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(*args, policy=policy, rngs=nnx.Rngs(0))))
  state = jax.vmap(lambda k: nnx.state(cls(*args, policy=policy, rngs=nnx.Rngs(k))))(keys)
  state = jax.tree.map(lambda v: _prepend_axis(v, VISION_LAYERS_AXIS), state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.merge(graphdef, state)


class Qwen3VLVisionTower(nnx.Module):
  """tower(patches [L, C T p p], layout) -> (tokens [L / m^2, out_dim], DeepStack features [len(indexes), L / m^2, out_dim]).

  layout: `grid_layout(grids, spec)` for the images packed in patches. remat wraps each scanned block's function.
  """

  def __init__(self, spec: Qwen3VLVisionSpec, *, policy: Policy, rngs: nnx.Rngs, remat: Remat | None = None):
    self.spec = spec
    self.policy = policy
    self.remat = remat
    s = spec
    kw = dict(dense_kwargs(policy, rngs), use_bias=True, quant=None)
    self.patch_embed = DenseGeneral((s.num_channels, s.temporal_patch_size, s.patch_size, s.patch_size), (s.emb_dim,), (None, None, None, None, "embed"), **kw)
    self.position_embed = nnx.Param(
      jax.random.normal(rngs.params(), (s.num_position_embeddings, s.emb_dim), jnp.float32).astype(policy.dtypes.params), logical_axes=(None, "embed")
    )
    self.blocks = _stacked(Qwen3VLVisionBlock, s.num_layers, policy, jax.random.split(rngs.params(), s.num_layers), s)
    self.merger = PatchMerger(s, False, policy=policy, rngs=rngs)
    n_deep = len(s.deepstack_indexes)
    self.deepstack_mergers = _stacked(PatchMerger, n_deep, policy, jax.random.split(rngs.params(), n_deep), s, True) if n_deep else None

  def __call__(self, patches: jax.Array, layout: GridLayout) -> tuple[jax.Array, jax.Array]:
    s = self.spec
    compute = self.policy.dtypes.compute
    x = patches.astype(compute).reshape(1, -1, s.num_channels, s.temporal_patch_size, s.patch_size, s.patch_size)
    x = self.patch_embed(x)
    table = self.position_embed[...].astype(jnp.float32)
    positions = jnp.sum(table[jnp.asarray(layout.taps)] * jnp.asarray(layout.weights)[..., None], axis=1)
    x = constrain(x + positions.astype(x.dtype), ACTIVATION, s.rules)
    angles = rotary_angles(jnp.asarray(layout.rows_cols), s.head_dim, s.rope_theta)
    segments = jnp.asarray(layout.segments)
    same_frame = segments[:, None] == segments[None, :]
    graphdef, state = nnx.split(self.blocks)

    def body(h: jax.Array, block_state) -> tuple[jax.Array, None]:
      return nnx.merge(graphdef, block_state)(h, angles, same_frame), None

    if self.remat is not None:
      body = self.remat(body)
    deep = []
    start = 0
    for end in (*[i + 1 for i in s.deepstack_indexes], s.num_layers):  # scan each run of blocks up to a DeepStack output
      if end > start:
        x, _ = jax.lax.scan(body, x, jax.tree.map(lambda a, lo=start, hi=end: a[lo:hi], state))
      if len(deep) < len(s.deepstack_indexes) and end == s.deepstack_indexes[len(deep)] + 1:
        merger_graph, merger_state = nnx.split(self.deepstack_mergers)
        deep.append(nnx.merge(merger_graph, jax.tree.map(lambda a, j=len(deep): a[j], merger_state))(x)[0])
      start = end
    tokens = self.merger(x)[0]
    return tokens, jnp.stack(deep) if deep else jnp.zeros((0, *tokens.shape), tokens.dtype)
