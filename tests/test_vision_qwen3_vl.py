"""Qwen3-VL's vision transformer against transformers' Qwen3VLVisionModel (tiny, random, float32, eager): merged
image tokens and DeepStack features for two packed images of different grids, preprocessed here; the preprocessing
against Qwen2VLImageProcessorPil."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from maxtext.models import remat
from maxtext.platform import Dtypes, Policy
from maxtext.vision import convert, preprocess
from maxtext.vision.qwen3_vl import Qwen3VLVisionSpec, Qwen3VLVisionTower, grid_layout
from tests.test_vision_siglip import remat_regions

PATCHING = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)
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
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((45, 61, 3), (30, 17, 3))]  # sides not multiples of 4
  patches, grids = preprocess.qwen3_vl_patches(images, **PATCHING)  # grids 12 x 16 and 8 x 4 against a 4 x 4 position table
  length = len(patches)
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
  tokens, deep = nnx.jit(lambda t, x, layout: t(x, layout))(tower, jnp.asarray(patches), grid_layout(grids, spec))  # the layout as a traced input
  np.testing.assert_allclose(np.asarray(tokens), out.pooler_output.numpy(), rtol=0, atol=1e-4)
  assert deep.shape == (2, length // 4, 24)
  for j, expected in enumerate(out.deepstack_features):
    np.testing.assert_allclose(np.asarray(deep[j]), expected.numpy(), rtol=0, atol=1e-4)


def test_patches_match_the_hf_processor():
  """Images whose sides are not multiples of the patch size (resized by smart_resize) and one above max_pixels."""
  rng = np.random.default_rng(1)
  images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((45, 61, 3), (30, 17, 3), (150, 90, 3))]
  processor = transformers.Qwen2VLImageProcessorPil(**PATCHING, image_mean=list(preprocess.QWEN3_VL_MEAN), image_std=list(preprocess.QWEN3_VL_STD))
  theirs = processor(images=images, return_tensors="np")
  patches, grids = preprocess.qwen3_vl_patches(images, **PATCHING)
  assert grids == [tuple(g) for g in theirs["image_grid_thw"].tolist()]
  assert grids[2][1] * grids[2][2] * 16 <= 64 * 64  # the large image was scaled down to the budget
  np.testing.assert_allclose(patches, theirs["pixel_values"], rtol=0, atol=1e-6)


def test_remat_wraps_each_scanned_block():
  """remat reaches the scan body of both runs of blocks (before and after the DeepStack output of block 0)."""
  spec = Qwen3VLVisionSpec(emb_dim=16, mlp_dim=16, num_layers=3, num_heads=2, out_dim=8, patch_size=2, num_position_embeddings=4, deepstack_indexes=(0,))
  patches, layout = jnp.ones((8, 3 * 2 * 2 * 2)), grid_layout([(1, 2, 4)], spec)
  counts = []
  for remat_fn in (None, functools.partial(remat.wrap, name="full", prevent_cse=False)):
    tower = nnx.eval_shape(lambda r=remat_fn: Qwen3VLVisionTower(spec, policy=POLICY, rngs=nnx.Rngs(0), remat=r))
    counts.append(remat_regions(jax.make_jaxpr(lambda t: t(patches, layout))(tower).jaxpr))
  assert counts == [0, 2]
