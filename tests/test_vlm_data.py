"""Image-text data (use_multimodal): jsonl records with images (paths relative to the file, data URIs), placeholders,
SFT masks, packing with the images riding along their tokens, resumable state, and the embedded pictures."""

from __future__ import annotations

import base64
import io

import jax
import numpy as np
import pytest
from PIL import Image

from maxtext.data import pipeline, shapes
from maxtext.data.features import IMAGE_KEY
from maxtext.data.iterator import DataIterator
from maxtext.vision import gemma3_encoder, preprocess
from tests.test_data_common import config, mesh_for, write_jsonl

IMAGE_SIZE, TOKENS, IMAGE_ID = 16, 4, 500  # 16 x 16 pictures, 4 soft tokens each, placeholder id 500 (the tokenizer has 320)
VISION = dict(
  decoder_block="gemma3",
  use_multimodal=True,
  image_size_for_vit=IMAGE_SIZE,
  patch_size_for_vit=4,
  hidden_size_for_vit=16,
  intermediate_size_for_vit=32,
  num_hidden_layers_for_vit=1,
  num_attention_heads_for_vit=2,
  mm_tokens_per_image=TOKENS,
  image_token_id=IMAGE_ID,
  image_placeholder="<image>",
  use_sft=True,
  train_data_columns=["prompt", "completion"],
  max_target_length=48,
)


def picture(seed: int, size=(20, 13)) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def png(image: np.ndarray) -> bytes:
  out = io.BytesIO()
  Image.fromarray(image).save(out, format="PNG")
  return out.getvalue()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("vlm_data")
  (d / "pics").mkdir()
  records = []
  for i in range(12):
    first, second = picture(i), picture(100 + i, (9, 30))
    (d / "pics" / f"{i}.png").write_bytes(png(first))
    uri = "data:image/png;base64," + base64.b64encode(png(second)).decode()
    two = i % 3 == 0  # every third record has two images
    prompt = f"doc {i} <image> what is it" + (" and <image> this" if two else "")
    records.append({"prompt": prompt, "completion": f" answer {i}", "image": [f"pics/{i}.png", uri] if two else f"pics/{i}.png"})
  write_jsonl(d / "train.jsonl", records)
  return d, records


def cfg(data_dir, **overrides):
  return config(**{**VISION, "grain_train_files": str(data_dir / "train.jsonl"), **overrides})


def test_encoder_places_images_and_masks_them(data_dir):
  d, records = data_dir
  c = cfg(d)
  encoder = pipeline.make_encoder(c, pipeline.resolve_tokenizer(c))
  doc = encoder.encode(records[0], f"{d / 'train.jsonl'} line 1")
  tokens = doc["tokens"]
  assert (tokens == IMAGE_ID).sum() == 2 * TOKENS and doc[IMAGE_KEY].shape == (len(tokens), IMAGE_SIZE * IMAGE_SIZE * 3 // TOKENS)
  assert not doc["mask"][tokens == IMAGE_ID].any()  # placeholders are never targets
  assert doc["mask"][-3:].all() and not doc["mask"][: np.flatnonzero(tokens == IMAGE_ID)[-1]].any()  # SFT: the completion only
  # The chunks put back together are the images preprocessed as the HF processor does (bit-exact).
  images = np.asarray(gemma3_encoder.images_from_tokens(doc[IMAGE_KEY][None], tokens[None], spec(c)))[0]
  expected = preprocess.gemma3_pixels([picture(0), picture(100, (9, 30))], IMAGE_SIZE)
  assert images.shape[0] == len(tokens) // TOKENS
  np.testing.assert_array_equal(images[:2], expected)
  assert not images[2:].any() or np.all(images[2:] == images[2:].flat[0])


def spec(c):
  from maxtext.models import vision_specs

  return vision_specs.vision(c)


def test_packed_rows_carry_each_documents_images(data_dir):
  """Packed rows: every segment's placeholders get its own document's images, in order."""
  d, records = data_dir
  c = cfg(d, packing=True, per_device_batch_size=1, max_target_length=96)
  ds, _ = pipeline.local_batches(c, "train", 0, 1, 4)
  batch = next(iter(ds))
  images = np.asarray(gemma3_encoder.images_from_tokens(batch[IMAGE_KEY], batch["inputs"], spec(c)))
  tokenizer = pipeline.resolve_tokenizer(c)
  found = 0
  for r in range(batch["inputs"].shape[0]):
    segments = batch["inputs_segmentation"][r]
    slot = 0
    for s in np.unique(segments[segments > 0]):
      text = tokenizer.decode([t for t in batch["inputs"][r][segments == s] if t != IMAGE_ID])
      i = int(text.split("doc ")[1].split()[0])
      expected = [picture(i)] + ([picture(100 + i, (9, 30))] if i % 3 == 0 else [])
      np.testing.assert_array_equal(images[r, slot : slot + len(expected)], preprocess.gemma3_pixels(expected, IMAGE_SIZE))
      slot, found = slot + len(expected), found + 1
  assert found > batch["inputs"].shape[0]  # rows held several documents


def test_iterator_state_resumes_with_images(data_dir):
  d, _ = data_dir
  c = cfg(d, packing=True, num_epoch=4)
  mesh = mesh_for(c)
  it = pipeline_iterator(c, mesh)
  next(it)
  state = it.get_state()
  expected = {k: np.asarray(jax.device_get(v)) for k, v in next(it).items()}
  resumed = pipeline_iterator(c, mesh)
  resumed.set_state(state)
  got = {k: np.asarray(jax.device_get(v)) for k, v in next(resumed).items()}
  assert got.keys() == expected.keys() and IMAGE_KEY in got and got[IMAGE_KEY].dtype == np.uint8
  for k in expected:
    np.testing.assert_array_equal(got[k], expected[k])


def pipeline_iterator(c, mesh) -> DataIterator:
  from maxtext.data import create_iterator

  return create_iterator(c, mesh, "train")


def test_embedded_pictures_are_fixed_and_answerable():
  first, again = shapes.record(3, "<image>"), shapes.record(3, "<image>")
  assert first == again and first["prompt"].startswith("<image>\n")
  answers = {shapes.record(i, "<image>")["completion"] for i in range(40)}
  assert len(answers) >= 6  # colours and shapes both asked
  train, held_out = shapes.documents("train", "<image>"), shapes.documents("eval", "<image>")
  assert len(train) + len(held_out) == shapes.RECORDS and len(held_out) == shapes.RECORDS // shapes.EVAL_EVERY
  image = np.asarray(Image.open(io.BytesIO(first["image"])))
  assert image.shape == (shapes.SIZE, shapes.SIZE, 3) and len(np.unique(image.reshape(-1, 3), axis=0)) >= 2
