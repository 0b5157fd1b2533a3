"""Shared helpers for the data tests: tiny corpora, a tiny sentencepiece model, configs and batch invariants."""

from __future__ import annotations

import functools
import json
import os
import tempfile

import numpy as np

from maxtext import mesh as mesh_lib
from maxtext.config import from_overrides
from maxtext.data.features import BATCH_KEYS

WORDS = "the model reads text and learns to predict the next token of every document in the data set".split()


def doc_text(i: int) -> str:
  """A document of varying length (3..20 words) that names its index."""
  rng = np.random.default_rng(i)
  return f"doc {i} " + " ".join(rng.choice(WORDS, size=3 + i * 7 % 18))


@functools.cache
def sp_model() -> str:
  """A 320-token sentencepiece model trained once per test session on the tiny corpus."""
  from maxtext.tokenizer import train_sentencepiece

  path = os.path.join(tempfile.mkdtemp(prefix="maxtext_sp_"), "tiny.model")
  texts = [doc_text(i) for i in range(200)] + [" ".join(WORDS) + " user assistant system: 0123456789 <|> ?!.,"] * 20
  return train_sentencepiece(texts, 320, path)


def write_jsonl(path, rows) -> str:
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def config(**overrides):
  base = dict(
    dataset_type="grain",
    grain_file_type="jsonl",
    tokenizer_type="sentencepiece",
    tokenizer_path=sp_model(),
    vocab_size=512,
    max_target_length=32,
    per_device_batch_size=1,
    grain_worker_count=0,
    grain_prefetch_buffer_size=0,
    enable_data_shuffling=False,
  )
  base.update(overrides)
  return from_overrides(num_devices=8, **base)


def mesh_for(cfg):
  return mesh_lib.create(cfg)


def check_row_invariants(batch: dict[str, np.ndarray]) -> None:
  """Segment ids 1,2,... then padding 0; positions restart per segment; targets are next inputs within a segment."""
  for k in BATCH_KEYS:
    assert batch[k].dtype == np.int32, k
  for r in range(batch["inputs"].shape[0]):
    seg, pos = batch["inputs_segmentation"][r], batch["inputs_position"][r]
    inp, tgt, tseg = batch["inputs"][r], batch["targets"][r], batch["targets_segmentation"][r]
    np.testing.assert_array_equal(batch["targets_position"][r], pos)
    used = seg > 0
    if used.any():
      last = np.flatnonzero(used)[-1]
      assert used[: last + 1].all(), "padding only at the end"
      ids = seg[: last + 1]
      assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1), "segment ids count up from 1"
    assert (inp[~used] == 0).all() and (pos[~used] == 0).all() and (tseg[~used] == 0).all()
    for s in np.unique(seg[used]):
      idx = np.flatnonzero(seg == s)
      np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))
      np.testing.assert_array_equal(tgt[idx[:-1]], inp[idx[1:]])
      assert tgt[idx[-1]] == 0 and tseg[idx[-1]] == 0, "the last token of a segment is not trained on"
      assert set(np.unique(tseg[idx]).tolist()) <= {0, int(s)}
