"""Training Llama 4 on image-text records (use_multimodal, decoder_block=llama4; tiny, random): each image cut into
tiles as Llama4ImageProcessor does, its place the processor's text for its tile grid, and packed rows whose loss is
their documents' loss alone, each run through the model with its tiles prepared as for decoding."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from maxtext import models
from maxtext.data import pipeline
from maxtext.data.features import IMAGE_KEY
from maxtext.train import loss as loss_lib
from maxtext.vision import llama4_preprocess
from tests.test_data_common import config, write_jsonl
from tests.test_vlm_qwen3_vl_train import doc_xent_of_logits, picture, png

TILE, TOKENS_PER_TILE, MAX_TILES, IMAGE_ID = 16, 4, 4, 500  # 4 x 4 patches per tile, pixel-shuffled to 4 tokens
LLAMA4 = dict(
  decoder_block="llama4",
  base_emb_dim=32,
  base_num_query_heads=2,
  base_num_kv_heads=2,
  head_dim=16,
  base_mlp_dim=64,
  base_num_decoder_layers=2,
  chunk_attn_window_size=64,
  use_multimodal=True,
  tile_size_for_vit=TILE,
  patch_size_for_vit=4,
  hidden_size_for_vit=32,
  intermediate_size_for_vit=128,
  num_hidden_layers_for_vit=2,
  num_attention_heads_for_vit=4,
  projector_input_dim_for_vit=24,
  projector_output_dim_for_vit=24,
  vision_output_dim_for_vit=24,
  max_num_tiles_for_vit=MAX_TILES,
  image_token_id=IMAGE_ID,
  image_placeholder="<image>",
  use_sft=True,
  train_data_columns=["prompt", "completion"],
  max_target_length=320,  # the markers around tiles are several ids each with the test tokenizer
  packing=True,
  dtype="float32",
  matmul_precision="highest",
)


def images_of(i: int) -> list[np.ndarray]:
  """Record i's pictures: a 11 x 9 (one tile), every third also a 20 x 37 (a 1 x 2 grid and its global tile)."""
  return [picture(i, (11, 9))] + ([picture(100 + i, (20, 37))] if i % 3 == 0 else [])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("llama4_data")
  records = []
  for i in range(10):
    paths = []
    for k, image in enumerate(images_of(i)):
      (d / f"{i}_{k}.png").write_bytes(png(image))
      paths.append(f"{i}_{k}.png")
    prompt = f"doc {i} <image> what is it" + (" and <image> this" if len(paths) == 2 else "")
    records.append({"prompt": prompt, "completion": f" answer {i}", "image": paths})
  write_jsonl(d / "train.jsonl", records)
  return d, records


def test_packed_rows_loss_equals_their_documents_alone(data_dir):
  """The pipeline's packed rows (tiles as uint8 per-token chunks, normalised in the step) give the loss of each
  document alone with its tiles from llama4_preprocess (the decode path, checked against transformers)."""
  d, records = data_dir
  c = config(**{**LLAMA4, "grain_train_files": str(d / "train.jsonl")})
  ds, _ = pipeline.local_batches(c, "train", 0, 1, 3)
  batch = next(iter(ds))
  assert batch[IMAGE_KEY].dtype == np.uint8
  model = models.build(c, nnx.Rngs(0))
  sums = nnx.jit(lambda m, b: loss_lib.loss_sums(m, b, c, training=False))(model, {k: jax.numpy.asarray(v) for k, v in batch.items()})
  # each document alone, padded after its end to one row length (causal: the padding changes none of its logits), so
  # that one program per tile count serves every document
  forward = nnx.jit(lambda m, t, tiles: m(t, images=tiles))
  tokenizer = pipeline.resolve_tokenizer(c)
  encoder = pipeline.make_encoder(c, tokenizer)
  xent, count, documents, tiles_seen = 0.0, 0, 0, 0
  for r in range(batch["inputs"].shape[0]):
    segments = batch["inputs_segmentation"][r]
    for s in np.unique(segments[segments > 0]):
      text = tokenizer.decode([t for t in batch["inputs"][r][segments == s] if t != IMAGE_ID])
      i = int(text.split("doc ")[1].split()[0])
      doc = encoder.encode(records[i], f"{d / 'train.jsonl'} line {i + 1}")
      tokens = doc["tokens"]
      np.testing.assert_array_equal(batch["inputs"][r][segments == s], tokens)
      tiles = llama4_preprocess.prompt_tiles(c, [tokens], [images_of(i)], 1)  # a one-line error unless the placeholders fit the tiles
      tiles_seen += int((tokens == IMAGE_ID).sum()) // TOKENS_PER_TILE
      padded = np.zeros((1, c.max_target_length), tokens.dtype)
      padded[0, : len(tokens)] = tokens
      logits = np.asarray(forward(model, padded, tiles), np.float64)[0, : len(tokens)]
      x, n = doc_xent_of_logits(logits, tokens, doc["mask"])
      xent, count, documents = xent + x, count + n, documents + 1
  assert documents > batch["inputs"].shape[0] and tiles_seen > documents  # rows held several documents, some of several tiles
  assert int(sums.weights) == count
  np.testing.assert_allclose(float(sums.xent), xent, rtol=2e-5)
