"""Qwen3-VL with images in (use_multimodal, vision_encoder_block=qwen3_vl) against transformers'
Qwen3VLForConditionalGeneration (tiny, random, float32, eager): logits with images placed, MRoPE and DeepStack,
packing, conversion both ways."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from maxtext.convert import hf_params
from maxtext.convert.model_params import flat_params
from maxtext.hf import from_hf, params_from_hf
from maxtext.vision import qwen3_vl_encoder

IMAGE_ID, VIDEO_ID, START, END = 299, 298, 297, 296
MIN_PIXELS, MAX_SIDE = 16 * 16, 64  # preprocessing: area within [256, 64 * 64]
OVERRIDES = dict(dtype="float32", matmul_precision="highest", min_pixels_for_vit=MIN_PIXELS, image_size_for_vit=MAX_SIDE)


def hf_config() -> transformers.Qwen3VLConfig:
  vision = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    out_hidden_size=48,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
  )
  rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2], "mrope_interleaved": True}
  text = dict(
    hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12, vocab_size=300, rope_parameters=rope
  )
  return transformers.Qwen3VLConfig(
    vision_config=vision, text_config=text, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START, vision_end_token_id=END
  )


def random_model(config: transformers.Qwen3VLConfig, seed: int = 0) -> transformers.Qwen3VLForConditionalGeneration:
  torch.manual_seed(seed)
  model = transformers.Qwen3VLForConditionalGeneration(config).eval().float()
  with torch.no_grad():  # non-trivial norms, biases and tower (HF initialises some of them to 0 or 1)
    for name, p in model.named_parameters():
      if "visual" in name or "norm" in name or "lm_head" in name:
        layer_norm_scale = "visual" in name and "norm" in name and name.endswith("weight")
        p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.2) + (1.0 if layer_norm_scale else 0.0))
  model.config._attn_implementation = "eager"
  model.model.visual.config._attn_implementation = "eager"
  model.model.language_model.config._attn_implementation = "eager"
  return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  model = random_model(hf_config())
  path = tmp_path_factory.mktemp("qwen3_vl")
  model.save_pretrained(path)
  return path, model


@pytest.fixture(scope="module")
def ours(hf_dir):
  return from_hf(hf_dir[0], **OVERRIDES)


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, (45, 61, 3), dtype=np.uint8), rng.integers(0, 256, (20, 17, 3), dtype=np.uint8)]  # sides not multiples of the patch


def processor() -> transformers.Qwen2VLImageProcessorPil:
  return transformers.Qwen2VLImageProcessorPil(
    patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=MIN_PIXELS, max_pixels=MAX_SIDE**2, image_mean=[0.5] * 3, image_std=[0.5] * 3
  )


def with_images(text: list[int], grids: list[tuple[int, int, int]]) -> list[int]:
  """text ids with an image per grid, each <start> n x <image> <end>, between its pieces."""
  out = list(text[:2])
  for k, grid in enumerate(grids):
    out += [START] + [IMAGE_ID] * qwen3_vl_encoder.tokens_per_image(grid, 2) + [END] + list(text[2 + 3 * k : 5 + 3 * k])
  return out


def grids_of(model, images) -> list[tuple[int, int, int]]:
  return qwen3_vl_encoder.row_patches(images, model.vision.spec)[1]


def hf_logits(model, ids: list[int], images: list[np.ndarray]) -> np.ndarray:
  out = processor()(images=images, return_tensors="pt")
  input_ids = torch.tensor([ids])
  with torch.no_grad():
    logits = model(
      input_ids=input_ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"], mm_token_type_ids=(input_ids == IMAGE_ID).int()
    ).logits
  return logits[0].numpy()


def our_logits(model, rows: list[list[int]], images: list[list[np.ndarray]], starts=None, positions=None, segment_ids=None) -> np.ndarray:
  tokens = np.asarray(rows, np.int32)
  batch, _ = qwen3_vl_encoder.prepare(rows, images, model.vision.spec, starts=starts)
  extra = {} if positions is None else dict(positions=np.asarray(positions, np.int32), segment_ids=np.asarray(segment_ids, np.int32))
  return np.asarray(jax.jit(lambda m, t, x: m(t, images=x, **extra))(model, tokens, batch))


def test_logits_match_transformers_with_two_images(hf_dir, ours, images):
  """Token ids with two images of different sizes (neither side a multiple of the patch); our preprocessing against
  transformers' image processor; MRoPE positions and DeepStack features as get_rope_index and the text model."""
  model = ours[0]
  grids = grids_of(model, images)
  assert grids == [(1, 12, 16), (1, 4, 4)]
  ids = with_images([2, 10, 11, 12, 13, 14, 15, 16, 17], grids)
  expected = hf_logits(hf_dir[1], ids, images)
  got = our_logits(model, [ids], [images])[0]
  assert got.shape == expected.shape
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
  blank = our_logits(model, [ids], [[np.zeros_like(im) for im in images]])[0]
  assert np.abs(blank - expected).max() > 1e-2  # the images matter


def test_mrope_and_deepstack_each_matter(ours, images):
  """Plain 1-D rope positions for the image tokens give other logits (MRoPE is exercised)."""
  model = ours[0]
  ids = with_images([2, 10, 11, 12, 13], grids_of(model, images[:1]))
  rows = np.asarray([ids], np.int32)
  batch, _ = qwen3_vl_encoder.prepare([ids], [images[:1]], model.vision.spec)
  full = np.asarray(model(rows, images=batch))
  flat = np.broadcast_to(np.arange(len(ids), dtype=np.int32)[None, :, None], (1, len(ids), 3))
  plain = np.asarray(model(rows, images=qwen3_vl_encoder.Qwen3VLImages(batch.patches, batch.layout, flat)))
  assert np.abs(full - plain).max() > 1e-3
  x, _ = model.multimodal_inputs(rows, batch)
  assert x.shape == (1, len(ids), 48)


def test_rope_index_matches_transformers(hf_dir, images):
  """Host MRoPE positions == Qwen3VLModel.get_rope_index, and the rope delta decoding continues from."""
  grids = [(1, 12, 16), (1, 6, 4)]  # one not square
  ids = with_images([2, 10, 11, 12, 13, 14, 15, 16, 17], grids)
  input_ids = torch.tensor([ids])
  theirs, delta = hf_dir[1].model.get_rope_index(input_ids, (input_ids == IMAGE_ID).int(), torch.tensor(grids))
  ours_pos, our_delta = qwen3_vl_encoder.rope_index(ids, grids, IMAGE_ID, 2)
  np.testing.assert_array_equal(ours_pos.T, theirs[:, 0].numpy())
  assert our_delta == int(delta[0, 0])


def test_packed_row_equals_documents_alone(ours, images):
  """Two documents, each with its own image, in one row (segment ids, positions restarting) == each run alone."""
  model = ours[0]
  first = with_images([2, 10, 11, 12, 13, 14], grids_of(model, images[:1]))
  second = with_images([2, 20, 21, 22, 23, 24], grids_of(model, images[1:]))
  alone = [our_logits(model, [first], [images[:1]])[0], our_logits(model, [second], [images[1:]])[0]]
  packed = our_logits(
    model,
    [first + second],
    [images],
    starts=[[0, len(first)]],
    positions=[list(range(len(first))) + list(range(len(second)))],
    segment_ids=[[1] * len(first) + [2] * len(second)],
  )[0]
  np.testing.assert_allclose(packed[: len(first)], alone[0], rtol=0, atol=1e-5)
  np.testing.assert_allclose(packed[len(first) :], alone[1], rtol=0, atol=1e-5)


def test_placeholders_must_fit_the_images(ours, images):
  model = ours[0]
  ids = with_images([2, 10, 11, 12, 13], grids_of(model, images[:1]))
  with pytest.raises(ValueError, match="placeholders"):
    qwen3_vl_encoder.prepare([ids[:-3]], [images[:1] * 2], model.vision.spec)
  with pytest.raises(ValueError, match="more image placeholders than images"):
    qwen3_vl_encoder.prepare([ids], [[]], model.vision.spec)


def saved_tensors(path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  return load_file(str(path / "model.safetensors"))


def test_conversion_bit_exact_both_ways(hf_dir, ours):
  path, _ = hf_dir
  config = ours[1]
  assert config.decoder_block == "qwen3" and config.vision_encoder_block == "qwen3_vl" and config.use_mrope and list(config.mrope_section) == [2, 2, 2]
  saved = saved_tensors(path)
  params = params_from_hf(path, config)
  assert any(k.startswith("vision/tower/blocks/") for k in params) and "vision/tower/deepstack_mergers/wa/kernel" in params
  back = hf_params.maxtext_to_hf(params, config)
  assert back.keys() == saved.keys()
  for name, value in saved.items():
    assert back[name].dtype == value.dtype and np.array_equal(back[name], value), name
  model_params = {k: np.asarray(v) for k, v in flat_params(ours[0]).items()}
  again = hf_params.hf_to_maxtext(hf_params.maxtext_to_hf(model_params, config), config)
  assert again.keys() == model_params.keys()
  for name, value in model_params.items():
    assert np.array_equal(again[name], value), name


def test_export_config_loads_in_transformers(ours, tmp_path):
  from maxtext.convert.hf_config_export import hf_config_from

  (tmp_path / "config.json").write_text(json.dumps(hf_config_from(ours[1])))
  loaded = transformers.AutoConfig.from_pretrained(tmp_path)
  assert type(loaded).__name__ == "Qwen3VLConfig" and loaded.image_token_id == IMAGE_ID
  assert loaded.vision_config.deepstack_visual_indexes == [0, 1] and loaded.text_config.rope_parameters["mrope_section"] == [2, 2, 2]


def test_greedy_decode_with_images_token_exact(hf_dir, ours, images):
  """Two prompts (one image; two images) decoded greedily in one batch == transformers' generate, token for token
  (the prefill encodes the images once; decode steps continue from each row's rope delta)."""
  from maxtext.inference import Generator
  from maxtext.inference.unstack import for_decoding

  model, config = ours
  hf_model = hf_dir[1]
  spec = model.vision.spec
  assert [qwen3_vl_encoder.image_tokens(im, spec) for im in images] == [48, 4]
  given = [images[1:], images]
  prompts = [with_images([2, 10, 11, 12, 13], grids_of(model, given[0])), with_images([2, 30, 31, 32, 33, 34, 35, 36], grids_of(model, given[1]))]
  total = 96
  gen = Generator(for_decoding(model), config=config, max_target_length=total, max_prefill_length=80, eos_id=1)
  got = gen.generate(prompts, images=given).tokens
  for prompt, row, tokens in zip(prompts, given, got):
    ids = torch.tensor([prompt])
    out = processor()(images=row, return_tensors="pt")
    with torch.no_grad():
      ref = hf_model.generate(
        input_ids=ids,
        pixel_values=out["pixel_values"],
        image_grid_thw=out["image_grid_thw"],
        mm_token_type_ids=(ids == IMAGE_ID).int(),
        max_new_tokens=total - len(prompt),
        do_sample=False,
        eos_token_id=1,
        pad_token_id=0,
      )[0, len(prompt) :].tolist()
    assert tokens == ref
  blank = gen.generate(prompts[:1], images=[[np.zeros_like(images[1])]]).tokens[0]
  assert got[0] != blank  # the image decides the output


def test_decode_command_with_an_image_token_exact(hf_dir, images, tmp_path, capsys):
  """`python -m maxtext.decode hf_model_path=... image_path=...`: the image's placeholders sized from the image, its
  greedy completion == transformers' generate on the same ids and pixels."""
  from PIL import Image

  from maxtext.decode import main
  from maxtext.tokenizer import load_tokenizer
  from tests.test_decode_cli import word_tokenizer

  tokenizer_path = word_tokenizer(tmp_path / "tokenizer.json", 297)  # <unk> <s> </s> w0 .. w296: the model's 300 ids
  Image.fromarray(images[0]).save(tmp_path / "a.png")
  total = 80
  args = [f"{k}={v}" for k, v in OVERRIDES.items()] + ["tokenizer_type=huggingface", f"tokenizer_path={tokenizer_path}", f"hf_model_path={hf_dir[0]}"]
  args += ["prompt=w1 <image> w2 w3", "image_placeholder=<image>", f"image_path={tmp_path / 'a.png'}", "add_bos=false"]
  main(["configs/base.yml", *args, f"max_target_length={total}", "max_prefill_predict_length=64"])
  out = capsys.readouterr().out
  completion = next(line for line in out.splitlines() if "completion: " in line).split("completion: ", 1)[1]
  prompt = [4] + [IMAGE_ID] * 48 + [5, 6]
  pixels = processor()(images=images[:1], return_tensors="pt")
  ids = torch.tensor([prompt])
  with torch.no_grad():
    ref = (
      hf_dir[1]
      .generate(
        input_ids=ids,
        pixel_values=pixels["pixel_values"],
        image_grid_thw=pixels["image_grid_thw"],
        mm_token_type_ids=(ids == IMAGE_ID).int(),
        max_new_tokens=total - len(prompt),
        do_sample=False,
        eos_token_id=2,
        pad_token_id=0,
      )[0, len(prompt) :]
      .tolist()
    )
  tokenizer = load_tokenizer("huggingface", tokenizer_path)
  assert len(ref) > 3 and completion == tokenizer.decode([t for t in ref if t != 2])


def test_moe_variant_logits_match_transformers(tmp_path, images):
  """Qwen3VLMoeForConditionalGeneration (qwen3_vl_moe: the qwen3_moe decoder, experts renormalised) with an image;
  its fused expert tensors convert both ways bit-exact."""
  text = dict(
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    vocab_size=300,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2], "mrope_interleaved": True},
  )
  vision = {**hf_config().vision_config.to_dict(), "deepstack_visual_indexes": [1]}
  config = transformers.Qwen3VLMoeConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_ID, vision_start_token_id=START, vision_end_token_id=END)
  torch.manual_seed(1)
  hf_model = transformers.Qwen3VLMoeForConditionalGeneration(config).eval().float()
  with torch.no_grad():
    for name, p in hf_model.named_parameters():
      if "visual" in name or "norm" in name or "lm_head" in name or "experts" in name:
        p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.2) + (1.0 if "visual" in name and "norm" in name and name.endswith("weight") else 0.0))
  hf_model.config._attn_implementation = "eager"
  hf_model.model.visual.config._attn_implementation = "eager"
  hf_model.model.language_model.config._attn_implementation = "eager"
  hf_model.save_pretrained(tmp_path)
  model, ours_config = from_hf(tmp_path, **OVERRIDES)
  assert ours_config.decoder_block == "qwen3_moe" and ours_config.num_experts == 4 and ours_config.norm_topk_prob
  ids = with_images([2, 10, 11, 12, 13], grids_of(model, images[1:]))
  np.testing.assert_allclose(our_logits(model, [ids], [images[1:]])[0], hf_logits(hf_model, ids, images[1:]), rtol=0, atol=1e-4)
  saved = saved_tensors(tmp_path)
  back = hf_params.maxtext_to_hf(params_from_hf(tmp_path, ours_config), ours_config)  # the fused experts split and joined again
  assert back.keys() == saved.keys() and all(np.array_equal(back[k], v) for k, v in saved.items())
