"""Gemma 3 with images in (use_multimodal) against transformers' Gemma3ForConditionalGeneration (tiny, random, float32,
eager): logits with images placed, packing, greedy decode with an image, conversion both ways, bad inputs."""

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
from maxtext.vision import preprocess

IMAGE_SIZE, PATCH, TOKENS, IMAGE_ID, BOI, EOI = 32, 4, 16, 299, 297, 298  # an 8 x 8 patch grid pooled 2 x 2 to 16 soft tokens
WINDOW = 12  # shorter than an image's run: the sliding layers cut into it


def hf_config(tie: bool = True) -> transformers.Gemma3Config:
  vision = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False
  )
  text = dict(
    hidden_size=24,
    intermediate_size=32,
    num_hidden_layers=6,  # 5 sliding layers and a global one
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=12,
    vocab_size=300,
    sliding_window=WINDOW,
    query_pre_attn_scalar=12,
    tie_word_embeddings=tie,
  )
  return transformers.Gemma3Config(
    vision_config=vision,
    text_config=text,
    mm_tokens_per_image=TOKENS,
    image_token_index=IMAGE_ID,
    boi_token_index=BOI,
    eoi_token_index=EOI,
    tie_word_embeddings=tie,
  )


def random_model(config: transformers.Gemma3Config, seed: int = 0) -> transformers.Gemma3ForConditionalGeneration:
  torch.manual_seed(seed)
  model = transformers.Gemma3ForConditionalGeneration(config).eval().float()
  with torch.no_grad():  # non-trivial norms and projector (HF initialises some of them to 0 or 1)
    for name, p in model.named_parameters():
      if "vision_tower" in name or "multi_modal_projector" in name or "norm" in name:
        layer_norm_scale = "vision_tower" in name and "norm" in name and name.endswith("weight")  # SigLIP's LayerNorm scales sit around 1
        p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.2) + (1.0 if layer_norm_scale else 0.0))
  model.config._attn_implementation = "eager"
  model.model.vision_tower.config._attn_implementation = "eager"
  model.model.language_model.config._attn_implementation = "eager"
  return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  model = random_model(hf_config())
  path = tmp_path_factory.mktemp("gemma3_vlm")
  model.save_pretrained(path)
  return path, model


@pytest.fixture(scope="module")
def ours(hf_dir):
  model, config = from_hf(hf_dir[0], dtype="float32", matmul_precision="highest")
  return model, config


@pytest.fixture(scope="module")
def images() -> list[np.ndarray]:
  rng = np.random.default_rng(0)
  return [rng.integers(0, 256, (45, 61, 3), dtype=np.uint8), rng.integers(0, 256, (20, 17, 3), dtype=np.uint8)]  # one larger, one smaller


def with_images(text: list[int], count: int) -> list[int]:
  """text ids with count images, each <boi> 16 x <image> <eoi>, between its pieces."""
  out = list(text[:2])
  for k in range(count):
    out += [BOI] + [IMAGE_ID] * TOKENS + [EOI] + list(text[2 + 3 * k : 5 + 3 * k])
  return out


def hf_logits(model, ids: list[int], pixels: np.ndarray) -> np.ndarray:
  input_ids = torch.tensor([ids])
  with torch.no_grad():
    out = model(input_ids=input_ids, pixel_values=torch.from_numpy(pixels), token_type_ids=(input_ids == IMAGE_ID).long())
  return out.logits[0].numpy()


def our_logits(model, ids, pixels, positions=None, segment_ids=None) -> np.ndarray:
  tokens = np.asarray([ids], np.int32)
  extra = {} if positions is None else dict(positions=np.asarray([positions], np.int32), segment_ids=np.asarray([segment_ids], np.int32))
  return np.asarray(jax.jit(lambda m, t, x: m(t, images=x, **extra))(model, tokens, pixels[None]))[0]


def test_logits_match_transformers_with_two_images(hf_dir, ours, images):
  """Token ids with two images of different sizes; our preprocessing against transformers' processor's pixels."""
  hf_model = hf_dir[1]
  ids = with_images([2, 10, 11, 12, 13, 14, 15, 16, 17], 2)
  processor = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)
  theirs_pixels = processor(images=images, return_tensors="np")["pixel_values"]
  expected = hf_logits(hf_model, ids, theirs_pixels)
  got = our_logits(ours[0], ids, preprocess.gemma3_pixels(images, IMAGE_SIZE))
  assert got.shape == expected.shape
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
  # The images matter, and so does their bidirectional attention: causal-only image tokens give other logits.
  blank = our_logits(ours[0], ids, np.zeros((2, IMAGE_SIZE, IMAGE_SIZE, 3), np.float32))
  assert np.abs(blank - expected).max() > 1e-2
  with torch.no_grad():
    causal = hf_model(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(theirs_pixels)).logits[0].numpy()
  assert np.abs(causal - expected).max() > 1e-3


def test_packed_row_equals_documents_alone(ours, images):
  """Two documents, each with its own image, in one row (segment ids, positions restarting) == each run alone."""
  model = ours[0]
  pixels = preprocess.gemma3_pixels(images, IMAGE_SIZE)
  first, second = with_images([2, 10, 11, 12, 13, 14], 1), with_images([2, 20, 21, 22, 23, 24], 1)
  alone = [our_logits(model, first, pixels[:1]), our_logits(model, second, pixels[1:])]
  packed = our_logits(
    model, first + second, pixels, positions=list(range(len(first))) + list(range(len(second))), segment_ids=[1] * len(first) + [2] * len(second)
  )
  np.testing.assert_allclose(packed[: len(first)], alone[0], rtol=0, atol=1e-5)
  np.testing.assert_allclose(packed[len(first) :], alone[1], rtol=0, atol=1e-5)


def saved_tensors(path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file

  return load_file(str(path / "model.safetensors"))


def test_conversion_bit_exact_both_ways(hf_dir, ours):
  path, _ = hf_dir
  config = ours[1]
  saved = saved_tensors(path)
  params = params_from_hf(path, config)
  assert any(k.startswith("vision/tower/blocks/") for k in params) and "vision/projector/projection/kernel" in params
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

  exported = hf_config_from(ours[1])
  (tmp_path / "config.json").write_text(json.dumps(exported))
  loaded = transformers.AutoConfig.from_pretrained(tmp_path)
  assert type(loaded).__name__ == "Gemma3Config" and loaded.mm_tokens_per_image == TOKENS and loaded.image_token_index == IMAGE_ID
  assert loaded.vision_config.num_hidden_layers == 2 and loaded.text_config.sliding_window == WINDOW


def test_greedy_decode_with_images_token_exact(hf_dir, ours, images):
  """Two prompts (one image; two images) decoded greedily in one batch == transformers' generate, token for token."""
  from maxtext.inference import Generator
  from maxtext.inference.unstack import for_decoding

  hf_model = hf_dir[1]
  prompts = [with_images([2, 10, 11, 12, 13], 1), with_images([2, 30, 31, 32, 33, 34, 35, 36], 2)]
  given = [images[1:], images]
  total = 64
  gen = Generator(for_decoding(ours[0]), config=ours[1], max_target_length=total, max_prefill_length=48, eos_id=1)
  got = gen.generate(prompts, images=given).tokens
  processor = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False)
  for prompt, row, tokens in zip(prompts, given, got):
    ids = torch.tensor([prompt])
    pixels = torch.from_numpy(processor(images=row, return_tensors="np")["pixel_values"])
    with torch.no_grad():
      ref = hf_model.generate(
        input_ids=ids,
        pixel_values=pixels,
        token_type_ids=(ids == IMAGE_ID).long(),
        max_new_tokens=total - len(prompt),
        do_sample=False,
        eos_token_id=1,
        pad_token_id=0,
      )[0, len(prompt) :].tolist()
    assert tokens == ref
  assert got[0] != gen.generate(prompts[:1], images=[[np.zeros((8, 8, 3), np.uint8)]]).tokens[0]  # the image decides the output


# --- bad inputs: one `error:` line, exit 2, nothing written (the helpers of tests/test_bad_inputs.py) ---------------

VLM_KEYS = (
  "decoder_block=gemma3",
  "use_multimodal=true",
  "image_size_for_vit=16",
  "patch_size_for_vit=4",
  "hidden_size_for_vit=16",
  "intermediate_size_for_vit=32",
  "num_hidden_layers_for_vit=1",
  "num_attention_heads_for_vit=2",
  "mm_tokens_per_image=4",
  "image_token_id=500",
  "image_placeholder=<image>",
)


def _vlm_train(*extra: str) -> list[str]:
  from tests.test_bad_inputs import GRAIN_JSONL, _train

  return _train(*GRAIN_JSONL, *VLM_KEYS, "grain_train_files={tmp}/data.jsonl", "use_sft=true", "train_data_columns=[prompt,completion]", *extra)


def _decode(*extra: str) -> list[str]:
  import sys

  from tests.test_bad_inputs import REPO, TINY

  keys = {**TINY, "tokenizer_path": "{sp}", "vocab_size": "512", "prompt": "look <image> here", **dict(e.split("=", 1) for e in extra)}
  return [sys.executable, "-m", "maxtext.decode", str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


def _make_vlm_inputs(tmp) -> None:
  import io

  from PIL import Image

  out = io.BytesIO()
  Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(out, format="PNG")
  (tmp / "pic.png").write_bytes(out.getvalue())
  (tmp / "broken.png").write_bytes(b"not an image at all")
  rows = {
    "data.jsonl": {"prompt": "a <image> b", "completion": " c", "image": "broken.png"},
    "two_places.jsonl": {"prompt": "a <image> b <image>", "completion": " c", "image": "pic.png"},
    "long.jsonl": {"prompt": "<image> <image> <image> <image> <image>", "completion": " c", "image": ["pic.png"] * 5},
  }
  for name, row in rows.items():
    (tmp / name).write_text(json.dumps(row) + "\n")


VLM_CASES = [
  ("unreadable_image", _vlm_train(), "not a readable"),
  ("more_places_than_images", _vlm_train("grain_train_files={tmp}/two_places.jsonl"), "2 '<image>' place(s) but 1 image(s)"),
  ("images_over_the_row_budget", _vlm_train("grain_train_files={tmp}/long.jsonl"), "an example with images must fit one row"),
  ("text_only_model_given_images", _decode("image_path={tmp}/pic.png"), "text-only model"),
  ("decode_image_unreadable", _decode(*VLM_KEYS, "image_path={tmp}/broken.png"), "not a readable"),
]


@pytest.fixture(scope="module")
def vlm_bad_results(tmp_path_factory):
  import concurrent.futures

  from tests.test_bad_inputs import _run_case
  from tests.test_data_common import sp_model

  sp, run = sp_model(), tmp_path_factory.mktemp("no_run")
  jobs = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    for case_id, argv, _ in VLM_CASES:
      tmp = tmp_path_factory.mktemp("vlm_case") / "work"
      tmp.mkdir()
      _make_vlm_inputs(tmp)
      jobs[case_id] = pool.submit(_run_case, argv, tmp, run, sp)
  return {k: v.result() for k, v in jobs.items()}


@pytest.mark.parametrize("case_id,argv,mention", VLM_CASES, ids=[c[0] for c in VLM_CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(vlm_bad_results, case_id, argv, mention):
  from tests.test_bad_inputs import assert_one_line_exit_2

  proc, before, after = vlm_bad_results[case_id]
  assert_one_line_exit_2(proc, mention)
  assert after == before
