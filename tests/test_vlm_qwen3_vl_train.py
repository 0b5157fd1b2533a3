"""Training Qwen3-VL on image-text records (use_multimodal, vision_encoder_block=qwen3_vl; tiny, random): each image's
placeholders and patches as Hugging Face's processor makes them, packed rows whose loss is their documents' loss
alone (MRoPE positions restarting per document), a short training run, and resumable iterator state."""

from __future__ import annotations

import io

import jax
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from maxtext import models
from maxtext.data import create_iterator, pipeline, qwen3_vl_records
from maxtext.data.features import GRID_KEY, PATCH_KEY
from maxtext.models import vision_specs
from maxtext.train import loss as loss_lib
from maxtext.train import setup as setup_lib
from maxtext.vision import qwen3_vl_encoder
from tests.test_data_common import config, mesh_for, write_jsonl
from tests.test_train_helpers import FAST_COMPILE

IMAGE_ID, PATCH, BUDGET = 500, 4, 48  # the sentencepiece tokenizer has 320 ids; images in 4 x 4 patches, 48 a row
QWEN3_VL = dict(
  decoder_block="qwen3",
  use_multimodal=True,
  vision_encoder_block="qwen3_vl",
  use_mrope=True,
  mrope_section=[4, 2, 2],
  base_emb_dim=32,
  base_num_query_heads=2,
  base_num_kv_heads=2,
  head_dim=16,
  base_mlp_dim=64,
  base_num_decoder_layers=2,
  hidden_size_for_vit=16,
  intermediate_size_for_vit=32,
  num_hidden_layers_for_vit=2,
  num_attention_heads_for_vit=2,
  out_hidden_size_for_vit=32,
  patch_size_for_vit=PATCH,
  num_position_embeddings_for_vit=16,
  deepstack_visual_indexes_for_vit=[0],
  image_size_for_vit=24,  # at most 24 x 24 pixels: 36 patches
  min_pixels_for_vit=64,
  max_patches_per_row_for_vit=BUDGET,
  image_token_id=IMAGE_ID,
  image_placeholder="<image>",
  use_sft=True,
  train_data_columns=["prompt", "completion"],
  max_target_length=80,
  packing=True,
  dtype="float32",
  matmul_precision="highest",
)


def picture(seed: int, size) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def png(image: np.ndarray) -> bytes:
  out = io.BytesIO()
  Image.fromarray(image).save(out, format="PNG")
  return out.getvalue()


def images_of(i: int) -> list[np.ndarray]:
  """Record i's pictures: one of 20 x 13 (2 x 2 merged tokens after resizing), every third also a 9 x 30 (1 x 4)."""
  return [picture(i, (20, 13))] + ([picture(100 + i, (9, 30))] if i % 3 == 0 else [])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("qwen3_vl_data")
  records = []
  for i in range(12):
    paths = []
    for k, image in enumerate(images_of(i)):
      (d / f"{i}_{k}.png").write_bytes(png(image))
      paths.append(f"{i}_{k}.png")
    prompt = f"doc {i} <image> what is it" + (" and <image> this" if len(paths) == 2 else "")
    records.append({"prompt": prompt, "completion": f" answer {i}", "image": paths if len(paths) == 2 else paths[0]})
  write_jsonl(d / "train.jsonl", records)
  return d, records


def cfg(data_dir, **overrides):
  return config(**{**QWEN3_VL, "grain_train_files": str(data_dir / "train.jsonl"), **overrides})


def test_documents_carry_their_images_as_the_processor_cuts_them(data_dir):
  """Each place holds its image's merged tokens; the patches, normalised on device, are the processor's (bit-exact)."""
  d, records = data_dir
  c = cfg(d)
  spec = vision_specs.vision(c)
  doc = pipeline.make_encoder(c, pipeline.resolve_tokenizer(c)).encode(records[0], f"{d / 'train.jsonl'} line 1")
  expected, grids = qwen3_vl_encoder.row_patches(images_of(0), spec)
  assert grids == [(1, 4, 4), (1, 2, 8)]  # 20 x 13 -> 16 x 16 pixels; 9 x 30 -> 8 x 32 (smart_resize)
  tokens = doc["tokens"]
  runs = [len(r) for r in np.split(tokens, np.flatnonzero(np.diff(tokens == IMAGE_ID)) + 1) if r[0] == IMAGE_ID]
  assert runs == [4, 4]  # h w / m^2 per image
  assert not doc["mask"][tokens == IMAGE_ID].any()
  assert doc["mask"][-3:].all() and not doc["mask"][: np.flatnonzero(tokens == IMAGE_ID)[-1] + 1].any()  # use_sft: the completion only
  assert [tuple(g) for g in doc[GRID_KEY] if g[0]] == grids and len(doc[PATCH_KEY]) == 32
  row = qwen3_vl_records.RowImages(spec, BUDGET)(
    {"inputs": tokens, "inputs_segmentation": np.ones_like(tokens), PATCH_KEY: doc[PATCH_KEY], GRID_KEY: doc[GRID_KEY]}
  )
  layout = qwen3_vl_encoder.layout_padded(grids, spec.tower, BUDGET)
  images = qwen3_vl_encoder.images_from_pixels(row[PATCH_KEY][None], layout, row["rope_positions"][None], spec)
  np.testing.assert_array_equal(np.asarray(images.patches)[0, :32], expected)
  np.testing.assert_array_equal(row["rope_positions"], qwen3_vl_encoder.rope_index(tokens, grids, IMAGE_ID, 2)[0])


def doc_xent(model, tokens: np.ndarray, mask: np.ndarray, images: list[np.ndarray], spec) -> tuple[float, int]:
  """A document alone through the model (images prepared on the host as for decoding): summed cross entropy of its
  trained targets and their count."""
  batch, _ = qwen3_vl_encoder.prepare([tokens.tolist()], [images], spec)
  return doc_xent_of_logits(np.asarray(model(tokens[None], images=batch), np.float64)[0], tokens, mask)


def doc_xent_of_logits(logits: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> tuple[float, int]:
  """A document's logits [S, V] -> (summed cross entropy of its targets whose mask is set, their count)."""
  logits = logits[:-1]
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  weights = mask[1:].astype(bool)
  return float(-logp[np.arange(len(weights)), tokens[1:]][weights].sum()), int(weights.sum())


@pytest.fixture(scope="module")
def packed(data_dir):
  d, records = data_dir
  c = cfg(d, per_device_batch_size=1)
  ds, _ = pipeline.local_batches(c, "train", 0, 1, 4)
  return c, next(iter(ds))


def test_packed_rows_loss_equals_their_documents_alone(data_dir, packed):
  """The training loss of packed rows (the step's loss_sums) == the sum of each document run alone through the model."""
  d, records = data_dir
  c, batch = packed
  spec = vision_specs.vision(c)
  model = models.build(c, nnx.Rngs(0))
  sums = loss_lib.loss_sums(model, {k: jax.numpy.asarray(v) for k, v in batch.items()}, c, training=False)
  encoder, tokenizer = pipeline.make_encoder(c, pipeline.resolve_tokenizer(c)), pipeline.resolve_tokenizer(c)
  xent, count, documents = 0.0, 0, 0
  for r in range(batch["inputs"].shape[0]):
    segments = batch["inputs_segmentation"][r]
    for s in np.unique(segments[segments > 0]):
      text = tokenizer.decode([t for t in batch["inputs"][r][segments == s] if t != IMAGE_ID])
      i = int(text.split("doc ")[1].split()[0])
      doc = encoder.encode(records[i], f"{d / 'train.jsonl'} line {i + 1}")
      np.testing.assert_array_equal(batch["inputs"][r][segments == s], doc["tokens"])
      x, n = doc_xent(model, doc["tokens"], doc["mask"], images_of(i), spec)
      xent, count, documents = xent + x, count + n, documents + 1
  assert documents > batch["inputs"].shape[0]  # rows held several documents (and several images)
  assert int(sums.weights) == count
  np.testing.assert_allclose(float(sums.xent), xent, rtol=2e-5)


def test_short_training_run_loss_falls(data_dir):
  """The jitted train step on the iterator's batches (images in): loss finite and falling on a repeated batch."""
  d, _ = data_dir
  c = cfg(d, per_device_batch_size=1, learning_rate=3e-3, warmup_steps_fraction=0.0, num_epoch=4)
  mesh = mesh_for(c)
  setup = setup_lib.build(c, mesh)
  batch = next(create_iterator(c, mesh, "train"))
  assert batch[PATCH_KEY].dtype == np.uint8 and batch[PATCH_KEY].shape[1] == BUDGET
  with jax.set_mesh(mesh):
    step = setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile(compiler_options=FAST_COMPILE)
    state = setup.init_state()
    losses = []
    for _ in range(4):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses


def test_iterator_state_resumes_with_images(data_dir):
  d, _ = data_dir
  c = cfg(d, num_epoch=4)
  mesh = mesh_for(c)
  it = create_iterator(c, mesh, "train")
  next(it)
  state = it.get_state()
  expected = {k: np.asarray(jax.device_get(v)) for k, v in next(it).items()}
  resumed = create_iterator(c, mesh, "train")
  resumed.set_state(state)
  got = {k: np.asarray(jax.device_get(v)) for k, v in next(resumed).items()}
  assert got.keys() == expected.keys() and {PATCH_KEY, "rope_positions", "image_taps"} <= got.keys()
  for k in expected:
    np.testing.assert_array_equal(got[k], expected[k])


def test_flops_count_the_towers_patch_budget_and_respect_freezing():
  """The tower's FLOPs per step by hand: every row runs its max_patches_per_row_for_vit patches (P) through the patch
  embedding and blocks, P / m^2 merged tokens through the mergers, the scores over P x P; frozen, forward only."""
  from maxtext import counting

  trained = config(**QWEN3_VL)
  frozen, no_tower = config(**QWEN3_VL, freeze_vision_encoder_params=True), config(**QWEN3_VL, dataset_type="synthetic")
  e, m, layers, out, p, merged = 16, 32, 2, 32, BUDGET, BUDGET // 4
  patch = 3 * 2 * PATCH * PATCH * e + e  # the (C, T, p, p) -> E dense with its bias
  block = 2 * 2 * e + (e * 3 * e + 3 * e) + (e * e + e) + (e * m + m) + (m * e + e)  # two layer norms, qkv, out, the MLP
  merger = 2 * e + (4 * e) ** 2 + 4 * e + 4 * e * out + out  # the final merger normalises each patch
  deep = 2 * 4 * e + (4 * e) ** 2 + 4 * e + 4 * e * out + out  # a DeepStack merger normalises each group of m^2
  scores = layers * 4 * p * p * e
  rows = trained.global_batch_size_to_train_on
  forward = rows * (2 * p * (patch + layers * block) + 2 * merged * (merger + deep) + scores)
  training = rows * (p * (4 * patch + 6 * layers * block) + 6 * merged * (merger + deep) + 3 * scores)  # the pixels need no gradient
  base = counting.training_flops_per_step(no_tower)
  assert counting.training_flops_per_step(trained) - base == pytest.approx(training, rel=1e-12)
  assert counting.training_flops_per_step(frozen) - base == pytest.approx(forward, rel=1e-12)
  assert counting.forward_flops_per_step(trained) - counting.forward_flops_per_step(no_tower) == pytest.approx(forward, rel=1e-12)
