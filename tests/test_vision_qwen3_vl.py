"""Qwen3-VL's vision transformer against transformers' Qwen3VLVisionModel (tiny, random, float32, eager): merged
image tokens and DeepStack features for two packed images of different grids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from maxtext.platform import Dtypes, Policy
from maxtext.vision import convert, preprocess
from maxtext.vision.qwen3_vl import Qwen3VLVisionSpec, Qwen3VLVisionTower, grid_layout

POLICY = Policy(platform="cpu", dtypes=Dtypes(params=jnp.float32, compute=jnp.float32, precision=jax.lax.Precision.HIGHEST))


def test_tokens_and_deepstack_match_transformers():
  config = transformers.Qwen3VLVisionConfig(
    depth=3,
    hidden_size=32,
    intermediate_size=40,
    num_heads=4,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=24,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
  )
  config._attn_implementation = "eager"
  torch.manual_seed(0)
  model = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel(config).eval().float()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.1) + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
  grids = [(1, 6, 8), (1, 4, 2)]  # a 6 x 8 grid interpolates the 4 x 4 position table; a smaller one too
  length = sum(t * h * w for t, h, w in grids)
  patches = np.random.default_rng(0).standard_normal((length, 3 * 2 * 4 * 4)).astype(np.float32)
  with torch.no_grad():
    out = model(torch.from_numpy(patches), grid_thw=torch.tensor(grids))
  spec = Qwen3VLVisionSpec(
    emb_dim=32,
    mlp_dim=40,
    num_layers=3,
    num_heads=4,
    out_dim=24,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
    deepstack_indexes=(0, 1),
    rope_theta=config.rope_parameters["rope_theta"],
  )
  tower = nnx.eval_shape(lambda: Qwen3VLVisionTower(spec, policy=POLICY, rngs=nnx.Rngs(0)))
  hf_weights = {k: v.numpy() for k, v in model.state_dict().items()}
  convert.load_params(tower, convert.qwen3_vl_from_hf(hf_weights, spec, prefix=""))
  back = convert.qwen3_vl_to_hf(convert.flat_params(tower), spec, prefix="")  # the mapping round-trips bit-exact
  assert back.keys() == hf_weights.keys() and all(np.array_equal(back[k], v) and back[k].dtype == v.dtype for k, v in hf_weights.items())
  tokens, deep = tower(jnp.asarray(patches), grid_layout(grids, spec))
  np.testing.assert_allclose(np.asarray(tokens), out.pooler_output.numpy(), rtol=0, atol=1e-4)
  assert deep.shape == (2, length // 4, 24)
  for j, expected in enumerate(out.deepstack_features):
    np.testing.assert_allclose(np.asarray(deep[j]), expected.numpy(), rtol=0, atol=1e-4)


def test_patches_match_the_hf_processor():
  """Images whose sides are not multiples of the patch size (resized by smart_resize) and one above max_pixels."""
  rng = np.random.default_rng(1)
  images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((45, 61, 3), (30, 17, 3), (150, 90, 3))]
  options = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)
  processor = transformers.Qwen2VLImageProcessorPil(**options, image_mean=list(preprocess.QWEN3_VL_MEAN), image_std=list(preprocess.QWEN3_VL_STD))
  theirs = processor(images=images, return_tensors="np")
  patches, grids = preprocess.qwen3_vl_patches(images, **options)
  assert grids == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
  assert grids[2][1] * grids[2][2] * 16 <= 64 * 64  # the large image was scaled down to the budget
  np.testing.assert_allclose(patches, theirs["pixel_values"], rtol=0, atol=1e-6)
