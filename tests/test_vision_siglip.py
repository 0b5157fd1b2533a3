"""Gemma 3's SigLIP tower, projector and preprocessing against transformers (tiny random Gemma3ForConditionalGeneration,
float32, eager): pixels, image soft tokens, and the weight mapping's round trip."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from maxtext.models import remat
from maxtext.platform import Dtypes, Policy
from maxtext.vision import convert, preprocess
from maxtext.vision.gemma3_projector import Gemma3Projector, Gemma3ProjectorSpec
from maxtext.vision.siglip import SiglipSpec, SiglipVisionTower

IMAGE_SIZE, PATCH, TOKENS = 32, 4, 16  # an 8 x 8 patch grid pooled 2 x 2 to 16 soft tokens
POLICY = Policy(platform="cpu", dtypes=Dtypes(params=jnp.float32, compute=jnp.float32, precision=jax.lax.Precision.HIGHEST))


@pytest.fixture(scope="module")
def hf_model() -> transformers.Gemma3ForConditionalGeneration:
  vision = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=PATCH,
    layer_norm_eps=1e-6,
    vision_use_head=False,  # as Gemma 3's checkpoints
  )
  text = dict(hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=12, vocab_size=300)
  config = transformers.Gemma3Config(
    vision_config=vision, text_config=text, mm_tokens_per_image=TOKENS, image_token_index=299, boi_token_index=297, eoi_token_index=298
  )
  torch.manual_seed(0)
  model = transformers.Gemma3ForConditionalGeneration(config).eval().float()
  with torch.no_grad():  # random, non-trivial norms and projector (HF initialises some of them to 0 or 1)
    for name, p in model.named_parameters():
      if "vision_tower" in name or "multi_modal_projector" in name:
        layer_norm_scale = "norm" in name and name.endswith("weight") and "mm_soft_emb_norm" not in name  # around 1; Gemma's RMSNorm stores 1 + s
        p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.2) + (1.0 if layer_norm_scale else 0.0))
  model.config._attn_implementation = "eager"
  model.model.vision_tower.config._attn_implementation = "eager"
  return model


@pytest.fixture(scope="module")
def specs(hf_model) -> tuple[SiglipSpec, Gemma3ProjectorSpec]:
  v = hf_model.config.vision_config
  tower = SiglipSpec(v.image_size, v.patch_size, v.hidden_size, v.intermediate_size, v.num_hidden_layers, v.num_attention_heads, v.layer_norm_eps)
  projector = Gemma3ProjectorSpec(
    tower.patches_per_side, v.hidden_size, hf_model.config.text_config.hidden_size, hf_model.config.mm_tokens_per_image, v.layer_norm_eps
  )
  return tower, projector


@pytest.fixture(scope="module")
def hf_weights(hf_model) -> dict[str, np.ndarray]:
  return {k: v.detach().numpy() for k, v in hf_model.state_dict().items() if "vision_tower" in k or "multi_modal_projector" in k}


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, (45, 61, 3), dtype=np.uint8), rng.integers(0, 256, (20, 17, 3), dtype=np.uint8)]  # one larger, one smaller


def ours(specs, hf_weights, remat_fn=None) -> tuple[SiglipVisionTower, Gemma3Projector]:
  tower_spec, projector_spec = specs
  # Built abstractly (no random init to run: every parameter comes from the checkpoint), as a converter would.
  tower = nnx.eval_shape(lambda: SiglipVisionTower(tower_spec, policy=POLICY, rngs=nnx.Rngs(1), remat=remat_fn))
  projector = nnx.eval_shape(lambda: Gemma3Projector(projector_spec, policy=POLICY, rngs=nnx.Rngs(2)))
  convert.load_params(tower, convert.siglip_from_hf(hf_weights, tower_spec))
  convert.load_params(projector, convert.projector_from_hf(hf_weights, projector_spec))
  return tower, projector


def test_pixels_match_the_hf_processor(images):
  processor = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)
  theirs = processor(images=images, return_tensors="np")["pixel_values"]  # [N, 3, S, S]
  mine = preprocess.gemma3_pixels(images, IMAGE_SIZE)
  assert mine.shape == (2, IMAGE_SIZE, IMAGE_SIZE, 3) and mine.dtype == np.float32
  np.testing.assert_allclose(mine, theirs.transpose(0, 2, 3, 1), rtol=0, atol=1e-6)


def test_preprocess_rejects_non_rgb():
  with pytest.raises(ValueError, match="uint8"):
    preprocess.gemma3_pixels([np.zeros((8, 8), np.uint8)], IMAGE_SIZE)


def test_soft_tokens_match_transformers(hf_model, specs, hf_weights, images):
  pixels = preprocess.gemma3_pixels(images, IMAGE_SIZE)
  with torch.no_grad():
    expected = hf_model.model.get_image_features(torch.from_numpy(pixels.transpose(0, 3, 1, 2))).pooler_output.numpy()
  tower, projector = ours(specs, hf_weights)
  got = np.asarray(jax.jit(lambda x: projector(tower(x)))(pixels))
  assert got.shape == expected.shape == (2, TOKENS, 24)
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
  assert not np.allclose(got[0], got[1], atol=1e-2)  # the two images give different tokens


def remat_regions(jaxpr) -> int:
  """How many jax.checkpoint regions run in a jaxpr, nested ones included (the primitive is remat2 or checkpoint, by JAX version)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in ("remat2", "checkpoint")
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns"):
        count += remat_regions(inner)
  return count


def test_remat_wraps_each_scanned_block(specs, hf_weights, images):
  """remat reaches the scan body: one jax.checkpoint region around the block."""
  pixels = jnp.asarray(preprocess.gemma3_pixels(images, IMAGE_SIZE))
  counts = []
  for remat_fn in (None, functools.partial(remat.wrap, name="full", prevent_cse=False)):
    tower, _ = ours(specs, hf_weights, remat_fn)
    counts.append(remat_regions(jax.make_jaxpr(lambda t: t(pixels))(tower).jaxpr))
  assert counts == [0, 1]


def test_weights_round_trip_bit_exact(specs, hf_weights):
  tower_spec, projector_spec = specs
  tower, projector = ours(specs, hf_weights)
  back = {**convert.siglip_to_hf(convert.flat_params(tower), tower_spec), **convert.projector_to_hf(convert.flat_params(projector), projector_spec)}
  assert back.keys() == hf_weights.keys()
  for name, value in hf_weights.items():
    assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name


def test_blocks_are_stacked_with_logical_axes(specs, hf_weights):
  tower, _ = ours(specs, hf_weights)
  kernel = tower.blocks.attention.query.kernel
  assert kernel[...].shape == (2, 32, 4, 8)
  assert kernel.get_metadata()["logical_axes"] == ("vision_layers", "embed", "heads", "head_dim")
