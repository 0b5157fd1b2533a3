"""Llama 4 with images in (use_multimodal, decoder_block=llama4) against transformers' Llama4ForConditionalGeneration
(tiny, random, float32, eager): tiles as Llama4ImageProcessor makes them, logits with images of two sizes placed,
greedy decode with an image, conversion both ways."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
import torch
import transformers

from maxtext.convert import hf_params
from maxtext.convert.model_params import flat_params
from maxtext.hf import from_hf, params_from_hf
from maxtext.vision import llama4_preprocess
from tests.hf_fixtures import away_from_init
from tests.test_llama4 import tiny_config as text_config

TILE, PATCH, MAX_TILES = 16, 4, 4  # 4 x 4 patches per tile, pixel-shuffled to 4 soft tokens
TOKENS_PER_TILE = 4
IMAGE_ID, START, END, MARK, X_SEP, Y_SEP = 96, 90, 91, 92, 93, 94  # <|patch|> and the tokens around an image's placeholders


def hf_config() -> transformers.Llama4Config:
  vision = dict(
    hidden_size=32,
    intermediate_size=128,  # = hidden / ratio^2: the shuffled width the adapter reads
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=TILE,
    patch_size=PATCH,
    pixel_shuffle_ratio=0.5,
    projector_input_dim=24,
    projector_output_dim=24,
    vision_output_dim=24,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
  )
  return transformers.Llama4Config(
    vision_config=vision, text_config=text_config().to_dict(), image_token_index=IMAGE_ID, boi_token_index=START, eoi_token_index=END
  )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  torch.manual_seed(0)
  model = transformers.Llama4ForConditionalGeneration(hf_config()).eval().float()
  away_from_init(model)
  model.config._attn_implementation = "eager"
  model.vision_model.config._attn_implementation = "eager"
  model.language_model.config._attn_implementation = "eager"
  path = tmp_path_factory.mktemp("llama4_vlm")
  model.save_pretrained(path)
  return path, model


@pytest.fixture(scope="module")
def ours(hf_dir):
  return from_hf(hf_dir[0], dtype="float32", matmul_precision="highest", max_num_tiles_for_vit=MAX_TILES)


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, (20, 37, 3), dtype=np.uint8), rng.integers(0, 256, (11, 9, 3), dtype=np.uint8)]  # 2 x 2 tiles + global; one tile


def image_ids(grid: tuple[int, int]) -> list[int]:
  """The ids Llama4Processor's text for an image of this grid tokenizes to (llama4_preprocess.image_text)."""
  names = {"<|image_start|>": START, "<|image_end|>": END, "<|image|>": MARK, "<|tile_x_separator|>": X_SEP, "<|tile_y_separator|>": Y_SEP, "P": IMAGE_ID}
  text = llama4_preprocess.image_text(grid, TOKENS_PER_TILE, patch="P")
  out, i = [], 0
  while i < len(text):
    name = next(n for n in names if text.startswith(n, i))
    out.append(names[name])
    i += len(name)
  return out


def prompt(grids: list[tuple[int, int]]) -> list[int]:
  ids = [1, 10, 11]
  for k, grid in enumerate(grids):
    ids += image_ids(grid) + [20 + k, 30 + k]
  return ids


def hf_embeddings(model, ids: list[int], pixels: np.ndarray) -> torch.Tensor:
  """Llama4ForConditionalGeneration's input embeddings, built by its own modules as its forward does (transformers
  5.24's forward itself fails building its output object: MoeCausalLMOutputWithPast has no image_outputs)."""
  with torch.no_grad():
    input_ids = torch.tensor([ids])
    embeds = model.get_input_embeddings()(input_ids)
    features = model.vision_model(torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy())).last_hidden_state
    projected = model.multi_modal_projector(features.reshape(-1, features.shape[-1]))
    return embeds.masked_scatter((input_ids == model.config.image_token_id).unsqueeze(-1), projected)


def hf_logits(model, ids: list[int], pixels: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model.language_model(inputs_embeds=hf_embeddings(model, ids, pixels)).logits[0].numpy()


def our_logits(model, ids: list[int], tiles: np.ndarray) -> np.ndarray:
  return np.asarray(jax.jit(lambda m, t, x: m(t, images=x))(model, np.asarray([ids], np.int32), tiles[None]))[0]


def processor_tiles(images) -> np.ndarray | None:
  """transformers' Llama4ImageProcessor's tiles, HWC float32 (None without torchvision, which it needs)."""
  try:
    import torchvision  # noqa: F401
  except ImportError:
    return None
  processor = transformers.Llama4ImageProcessor(size={"height": TILE, "width": TILE}, max_patches=MAX_TILES)
  return processor(images=images, return_tensors="pt")["pixel_values"].float().numpy().transpose(0, 2, 3, 1)


def test_tiles_and_grids_are_the_processors(images):
  """Our tiles against transformers' Llama4ImageProcessor, bit for bit (needs torchvision; skipped without it)."""
  pytest.importorskip("torchvision")
  processor = transformers.Llama4ImageProcessor(size={"height": TILE, "width": TILE}, max_patches=MAX_TILES)
  rng = np.random.default_rng(1)
  more = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((70, 23, 3), (33, 17, 3), (45, 61, 3))]
  theirs = processor(images=images + more, return_tensors="pt")
  tiles, grids = llama4_preprocess.llama4_pixels(images + more, TILE, MAX_TILES)
  assert grids == [tuple(r) for r in theirs["aspect_ratios"].tolist()]
  np.testing.assert_array_equal(tiles, theirs["pixel_values"].float().numpy().transpose(0, 2, 3, 1))


@pytest.mark.parametrize("size, to", [((20, 37), (17, 32)), ((45, 61), (16, 16)), ((11, 9), (16, 13)), ((300, 200), (37, 90))])
def test_resize_is_torchs_antialiased_uint8_bilinear(size, to):
  """The resize the processor runs (torchvision on uint8 calls torch's interpolate), bit for bit, down and up."""
  image = np.random.default_rng(2).integers(0, 256, (*size, 3), dtype=np.uint8)
  ref = torch.nn.functional.interpolate(torch.from_numpy(image.transpose(2, 0, 1).copy())[None], size=to, mode="bilinear", align_corners=False, antialias=True)
  np.testing.assert_array_equal(llama4_preprocess.resize(image, *to), ref[0].numpy().transpose(1, 2, 0))


def test_grids_and_canvases():
  assert llama4_preprocess.llama4_tiles(np.zeros((20, 37, 3), np.uint8), TILE, MAX_TILES)[0].shape == (5, TILE, TILE, 3)
  assert llama4_preprocess.llama4_tiles(np.zeros((70, 23, 3), np.uint8), TILE, MAX_TILES)[1] == (4, 1)
  assert llama4_preprocess.llama4_tiles(np.zeros((11, 9, 3), np.uint8), TILE, MAX_TILES)[1] == (1, 1)
  assert image_ids((1, 1)) == [START, MARK] + [IMAGE_ID] * 4 + [END]


def test_logits_match_transformers_with_two_images(hf_dir, ours, images):
  hf_model = hf_dir[1]
  tiles, grids = llama4_preprocess.llama4_pixels(images, TILE, MAX_TILES)
  ids = prompt(grids)
  assert ids.count(IMAGE_ID) == len(tiles) * TOKENS_PER_TILE
  theirs = processor_tiles(images)  # transformers' own preprocessing where torchvision is installed
  expected = hf_logits(hf_model, ids, tiles if theirs is None else theirs)
  got = our_logits(ours[0], ids, tiles)
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
  blank = our_logits(ours[0], ids, np.zeros_like(tiles))
  assert np.abs(blank - expected).max() > 1e-2


def test_greedy_decode_with_images_token_exact(hf_dir, ours, images):
  """Two prompts (one image; two images of two sizes) decoded greedily in one batch == transformers' generate (on its
  language model from the same input embeddings, see hf_embeddings), token for token."""
  from maxtext.inference import Generator
  from maxtext.inference.unstack import for_decoding

  hf_model = hf_dir[1]
  given = [images[1:], images]
  prompts = [prompt([llama4_preprocess.llama4_tiles(im, TILE, MAX_TILES)[1] for im in row]) for row in given]
  total = 64
  gen = Generator(for_decoding(ours[0]), config=ours[1], max_target_length=total, max_prefill_length=48, eos_id=2)
  got = gen.generate(prompts, images=given).tokens
  for ids, row, tokens in zip(prompts, given, got):
    tiles = llama4_preprocess.llama4_pixels(row, TILE, MAX_TILES)[0]
    with torch.no_grad():
      ref = hf_model.language_model.generate(
        inputs_embeds=hf_embeddings(hf_model, ids, tiles), max_new_tokens=total - len(ids), do_sample=False, eos_token_id=2, pad_token_id=0
      )[0].tolist()
    assert tokens == ref
  blank = gen.generate(prompts, images=[[np.zeros_like(im) for im in row] for row in given]).tokens  # same shapes: no new compile
  assert blank[0] != got[0] and blank[1] != got[1]  # the images decide the output


def test_decode_refuses_placeholders_that_do_not_match_the_tiles(ours, images):
  from maxtext.errors import DataError
  from maxtext.inference import Generator
  from maxtext.inference.unstack import for_decoding

  gen = Generator(for_decoding(ours[0]), config=ours[1], max_target_length=64, max_prefill_length=48, eos_id=2)
  with pytest.raises(DataError, match=r"prompt 0 holds 4 image placeholder ids, but its 1 image\(s\) make 5 tile\(s\) of 4"):
    gen.generate([prompt([(1, 1)])], images=[images[:1]])


class MarkerTokenizer:
  """A stand-in tokenizer: Llama 4's image markers one id each (the test's ids), other text one id per character."""

  MARKERS = {"<|image_start|>": START, "<|image_end|>": END, "<|image|>": MARK, "<|tile_x_separator|>": X_SEP, "<|tile_y_separator|>": Y_SEP}

  def encode(self, text: str) -> list[int]:
    return [self.MARKERS[text]] if text in self.MARKERS else [40 + ord(ch) % 40 for ch in text]


def test_decode_prompt_places_each_images_tiles(ours, images):
  """python -m maxtext.decode's prompt: each <|image|> place becomes its image's placeholder text, tiles by its grid."""
  from maxtext.errors import DataError

  config = ours[1]
  ids = llama4_preprocess.encode_prompt(config, MarkerTokenizer(), "ab<|image|>c<|image|>", images)
  grids = [llama4_preprocess.llama4_tiles(im, TILE, MAX_TILES)[1] for im in images]
  assert ids == MarkerTokenizer().encode("a") + MarkerTokenizer().encode("b") + image_ids(grids[0]) + MarkerTokenizer().encode("c") + image_ids(grids[1])
  with pytest.raises(DataError, match=re.escape("the prompt has 1 '<|image|>' place(s) but image_path gives 2 image(s)")):
    llama4_preprocess.encode_prompt(config, MarkerTokenizer(), "<|image|>", images)


def saved_tensors(path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  return load_file(str(path / "model.safetensors"))


def test_conversion_bit_exact_both_ways(hf_dir, ours):
  path, _ = hf_dir
  config = ours[1]
  assert config.use_multimodal and config.tile_size_for_vit == TILE and config.image_token_id == IMAGE_ID
  saved = saved_tensors(path)
  params = params_from_hf(path, config)
  assert "vision/tower/adapter/wa/kernel" in params and "vision/projector/projection/kernel" in params
  back = hf_params.maxtext_to_hf(params, config)
  assert back.keys() == saved.keys()
  for name, value in saved.items():
    np.testing.assert_array_equal(np.asarray(back[name]), value, err_msg=name)
  model_params = flat_params(ours[0])
  again = hf_params.hf_to_maxtext(back, config)
  assert again.keys() == model_params.keys()
  for name, value in model_params.items():
    np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(value), err_msg=name)


def test_export_loads_in_transformers_with_the_same_weights(hf_dir, ours, tmp_path):
  """The exported config.json and tensors build a Llama4ForConditionalGeneration whose weights are the original's."""
  from maxtext.convert.hf_config_export import hf_config_from

  (tmp_path / "config.json").write_text(json.dumps(hf_config_from(ours[1])))
  loaded = transformers.AutoConfig.from_pretrained(tmp_path)
  assert type(loaded).__name__ == "Llama4Config" and loaded.vision_config.image_size == TILE and loaded.image_token_index == IMAGE_ID
  model = transformers.Llama4ForConditionalGeneration(loaded)
  tensors = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(ours[0]).items()}, ours[1])
  state = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected and not [k for k in missing if "rotary" not in k]
  for name, value in hf_dir[1].state_dict().items():
    assert torch.equal(model.state_dict()[name], value), name


def test_remat_and_logical_axes_of_the_tower(ours):
  """remat_policy_for_vit wraps the scanned block (one jax.checkpoint region); stacked weights carry vision_layers."""
  import dataclasses

  from flax import nnx

  from maxtext.vision.llama4_vision import Llama4VisionEncoder
  from tests.test_vision_siglip import remat_regions

  model, config = ours
  spec = model.vision.spec
  tiles = np.zeros((1, 1, TILE, TILE, 3), np.float32)
  counts = []
  for policy in ("none", "full"):
    encoder = nnx.eval_shape(lambda p=policy: Llama4VisionEncoder(dataclasses.replace(spec, remat_policy=p), policy=model.policy, rngs=nnx.Rngs(0)))
    counts.append(remat_regions(jax.make_jaxpr(lambda e: e(tiles))(encoder).jaxpr))
  assert counts == [0, 1]
  kernel = model.vision.tower.blocks.attention.query.kernel
  assert kernel.get_metadata()["logical_axes"] == ("vision_layers", "embed", "heads", "head_dim")


def test_flops_count_tiles_and_leave_out_a_frozen_towers_backward(hf_dir, ours):
  """Per tile the tower runs P + 1 tokens through its blocks and P r^2 through the adapter and projector; freezing the
  tower removes its weight and input gradients and its backward attention scores."""
  import math

  from maxtext import counting
  from maxtext.hf import config_from_hf

  config = trained = ours[1]
  frozen = config_from_hf(hf_dir[0], dtype="float32", matmul_precision="highest", max_num_tiles_for_vit=MAX_TILES, freeze_vision_encoder_params=True)
  spec = ours[0].vision.spec
  p, t, e, m, a = spec.num_patches, spec.tokens_per_image, spec.emb_dim, spec.mlp_dim, spec.adapter_dim
  block = 2 * 2 * e + 4 * (e * e + e) + (e * m + m) + (m * e + e)
  tower = {
    "patch": (PATCH * PATCH * 3 * e, p),
    "norms": (4 * e, p + 1),
    "blocks": (spec.num_layers * block, p + 1),
    "adapter": (spec.shuffled_dim * a + a * a, t),
  }
  projector = a * config.emb_dim
  tiles = config.global_batch_size_to_train_on * (config.max_target_length // t)
  scores = spec.num_layers * 4 * (p + 1) ** 2 * e
  weight_grads = sum(2 * size * tokens for size, tokens in tower.values())
  input_grads = sum(2 * size * tokens for name, (size, tokens) in tower.items() if name != "patch") + 2 * projector * t
  difference = counting.training_flops_per_step(trained) - counting.training_flops_per_step(frozen)
  assert math.isclose(difference, tiles * (weight_grads + input_grads + 2 * scores), rel_tol=1e-12)
