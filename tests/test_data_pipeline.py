"""Data pipeline: grain JSONL/Parquet/ArrayRecord, TFDS, HF, embedded; packing, chunking, sharding, resume."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from maxtext import mesh as mesh_lib
from maxtext.data import create_iterator, features, pipeline, sources
from maxtext.data.records import encode_tf_example, parse_tf_example
from maxtext.errors import ConfigError, DataError
from maxtext.tokenizer import load_tokenizer
from tests.test_data_common import check_row_invariants, config, doc_text, mesh_for, sp_model, write_jsonl

N_DOCS = 64


@pytest.fixture(scope="module")
def jsonl_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("jsonl")
  write_jsonl(d / "a.jsonl", [{"text": doc_text(i), "id": i} for i in range(N_DOCS // 2)])
  write_jsonl(d / "b.jsonl", [{"text": doc_text(i), "id": i} for i in range(N_DOCS // 2, N_DOCS)])
  write_jsonl(d / "eval.jsonl", [{"text": doc_text(1000 + i)} for i in range(5)])
  return d


def local(cfg, split="train", pi=0, pc=1):
  """This process's numpy batches from the pipeline (no device arrays)."""
  ds, _ = pipeline.local_batches(cfg, split, pi, pc, cfg.global_batch_size_to_train_on // pc)
  return [{k: np.asarray(v) for k, v in b.items()} for b in ds]


def rows_of(batches):
  return [tuple(b["inputs"][r][b["inputs_segmentation"][r] > 0]) for b in batches for r in range(b["inputs"].shape[0])]


def segments_of(batches):
  out = []
  for b in batches:
    for r in range(b["inputs"].shape[0]):
      seg = b["inputs_segmentation"][r]
      out += [tuple(b["inputs"][r][seg == s]) for s in np.unique(seg[seg > 0])]
  return out


def test_rows_shift_chunk_truncate_pad():
  doc = {"tokens": np.arange(1, 8, dtype=np.int32), "mask": np.array([0, 1, 1, 1, 0, 1, 1], np.int32)}
  row = features.truncate(doc, 4)
  np.testing.assert_array_equal(row["inputs"], [1, 2, 3, 4])
  np.testing.assert_array_equal(row["targets"], [2, 3, 4, 0])
  np.testing.assert_array_equal(row["weights"], [1, 1, 1, 0])
  chunks = features.chunk(doc, 3)
  assert [c["inputs"].tolist() for c in chunks] == [[1, 2, 3], [4, 5, 6]]  # the lone trailing token has no target
  padded = features.pad_row(chunks[1], 5)
  np.testing.assert_array_equal(padded["inputs_segmentation"], [1, 1, 1, 0, 0])
  np.testing.assert_array_equal(padded["targets_segmentation"], [0, 1, 0, 0, 0])
  np.testing.assert_array_equal(padded["inputs_position"], [0, 1, 2, 0, 0])


def test_grain_jsonl_global_batches_are_sharded_and_valid(jsonl_files):
  cfg = config(grain_train_files=str(jsonl_files / "[ab].jsonl"), packing=True)
  mesh = mesh_for(cfg)
  it = create_iterator(cfg, mesh)
  batch = next(it)
  assert set(batch) == set(features.BATCH_KEYS)
  for v in batch.values():
    assert isinstance(v, jax.Array) and v.shape == (8, 32) and v.dtype == np.int32
    assert v.sharding.is_equivalent_to(mesh_lib.data_sharding(cfg, mesh), 2)
  host = {k: np.asarray(v) for k, v in batch.items()}
  check_row_invariants(host)
  assert host["inputs_segmentation"].max() > 1, "several documents share a packed row"
  tok = load_tokenizer("sentencepiece", sp_model())
  first = host["inputs"][0][host["inputs_segmentation"][0] == 1]
  assert first[0] == tok.bos_id and tok.decode(first[1:]).startswith("doc 0 ")


def test_packing_fills_rows_and_respects_max_segments(jsonl_files):
  files = str(jsonl_files / "[ab].jsonl")
  unpacked = local(config(grain_train_files=files, packing=False))
  packed = local(config(grain_train_files=files, packing=True))
  limited = local(config(grain_train_files=files, packing=True, max_segments_per_seq=2))
  for b in unpacked + packed + limited:
    check_row_invariants(b)
  assert all(b["inputs_segmentation"].max() <= 1 for b in unpacked)
  assert max(b["inputs_segmentation"].max() for b in limited) == 2
  assert len(packed) <= len(limited) < len(unpacked)
  every_doc = set(rows_of(local(config(grain_train_files=files, grain_eval_files=files, packing=False), "eval")))
  assert set(segments_of(packed)) <= every_doc and len(set(segments_of(packed))) > len(every_doc) - 8
  with pytest.raises(ConfigError, match="max_segments_per_seq"):
    local(config(grain_train_files=files, max_segments_per_seq=0))


def test_truncation_vs_chunking(tmp_path):
  long_doc = " ".join(doc_text(i) for i in range(8))
  path = write_jsonl(tmp_path / "long.jsonl", [{"text": long_doc}] * 8)
  n_tokens = len(load_tokenizer("sentencepiece", sp_model()).encode(long_doc)) + 2
  truncated = local(config(grain_train_files=path, packing=False, use_truncation=True))
  chunked = local(config(grain_train_files=path, packing=False, use_truncation=False))
  assert len(truncated) == 1 and (truncated[0]["inputs_segmentation"].sum(axis=1) == 32).all()
  rows = sum(b["inputs"].shape[0] for b in chunked)
  assert rows == 8 * -(-n_tokens // 32) - (8 if n_tokens % 32 == 1 else 0)
  tokens = sum(int((b["inputs_segmentation"] > 0).sum()) for b in chunked)
  assert tokens == 8 * n_tokens - (8 if n_tokens % 32 == 1 else 0)


def test_parquet_and_arrayrecord_sources(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  from array_record.python.array_record_module import ArrayRecordWriter

  texts = [doc_text(i) for i in range(16)]
  pq.write_table(pa.table({"text": texts, "n": list(range(16))}), tmp_path / "d.parquet", row_group_size=5)
  writer = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
  for i, t in enumerate(texts):
    writer.write(encode_tf_example({"text": t}) if i % 2 else json.dumps({"text": t}).encode())
  writer.close()
  want = sorted(rows_of(local(config(grain_train_files=write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts]), packing=False))))
  for kind, name in [("parquet", "d.parquet"), ("arrayrecord", "d.array_record")]:
    got = local(config(grain_train_files=str(tmp_path / name), grain_file_type=kind, packing=False))
    assert sorted(rows_of(got)) == want, kind
  with pytest.raises(DataError, match="column 'n' is not text"):
    local(config(grain_train_files=str(tmp_path / "d.parquet"), grain_file_type="parquet", train_data_columns=["n"]))


def test_tf_example_codec():
  raw = encode_tf_example({"text": "héllo", "other": b"\x00\x01"})
  assert parse_tf_example(raw) == {"text": "héllo".encode(), "other": b"\x00\x01"}


def test_shuffle_seed_and_epochs(jsonl_files):
  files = str(jsonl_files / "[ab].jsonl")
  plain = rows_of(local(config(grain_train_files=files, packing=False)))
  a = rows_of(local(config(grain_train_files=files, packing=False, enable_data_shuffling=True, data_shuffle_seed=1)))
  b = rows_of(local(config(grain_train_files=files, packing=False, enable_data_shuffling=True, data_shuffle_seed=1)))
  c = rows_of(local(config(grain_train_files=files, packing=False, enable_data_shuffling=True, data_shuffle_seed=2)))
  assert a == b and a != c and a != plain and sorted(a) == sorted(plain)
  two = rows_of(local(config(grain_train_files=files, packing=False, enable_data_shuffling=True, num_epoch=2)))
  assert len(two) == 2 * len(plain) and sorted(two[: len(plain)]) == sorted(plain) and two[: len(plain)] != two[len(plain) :]


def test_process_share_rows_are_disjoint():
  shares = [set(sources.process_share(103, i, 4)) for i in range(4)]
  assert all(len(s) == 25 for s in shares) and set().union(*shares) == set(range(100))


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_processes_load_disjoint_halves(jsonl_files, shuffle):
  cfg = config(grain_train_files=str(jsonl_files / "[ab].jsonl"), packing=False, enable_data_shuffling=shuffle)
  whole = rows_of(local(cfg))
  p0, p1 = rows_of(local(cfg, pi=0, pc=2)), rows_of(local(cfg, pi=1, pc=2))
  assert not set(p0) & set(p1)
  assert sorted(p0 + p1) == sorted(whole)


def test_two_processes_parquet_stream_share(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"text": [doc_text(i) for i in range(24)]}), tmp_path / "d.parquet", row_group_size=7)
  cfg = config(grain_train_files=str(tmp_path / "d.parquet"), grain_file_type="parquet", packing=False, per_device_batch_size=0.5)
  whole = rows_of(local(cfg))
  p0, p1 = rows_of(local(cfg, pi=0, pc=2)), rows_of(local(cfg, pi=1, pc=2))
  assert not set(p0) & set(p1) and sorted(p0 + p1) == sorted(whole)


@pytest.mark.parametrize("file_type", ["jsonl", "parquet"])
def test_resume_restores_exact_batches(jsonl_files, tmp_path, file_type):
  if file_type == "parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [doc_text(i) for i in range(N_DOCS)]}), tmp_path / "d.parquet", row_group_size=9)
    files = str(tmp_path / "d.parquet")
  else:
    files = str(jsonl_files / "[ab].jsonl")
  cfg = config(
    grain_train_files=files,
    grain_file_type=file_type,
    packing=True,
    enable_data_shuffling=True,
    data_shuffle_seed=7,
    grain_shuffle_buffer_size=16,
    num_epoch=3,
    use_truncation=False,
    grain_prefetch_buffer_size=2,
  )
  mesh = mesh_for(cfg)
  it = create_iterator(cfg, mesh)
  for _ in range(3):
    it.next_local()
  state = json.loads(json.dumps(it.get_state()))
  expected = [it.next_local() for _ in range(4)]
  resumed = create_iterator(cfg, mesh)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in features.BATCH_KEYS:
      np.testing.assert_array_equal(np.asarray(got[k]), want[k])


def test_eval_split_pads_last_batch_and_ends(jsonl_files):
  cfg = config(grain_train_files=str(jsonl_files / "a.jsonl"), grain_eval_files=str(jsonl_files / "eval.jsonl"), packing=False)
  batches = list(create_iterator(cfg, mesh_for(cfg), "eval"))
  assert len(batches) == 1
  seg = np.asarray(batches[0]["inputs_segmentation"])
  assert (seg.sum(axis=1) > 0).sum() == 5 and (seg[5:] == 0).all()


def test_eval_not_configured_is_config_error(jsonl_files):
  cfg = config(grain_train_files=str(jsonl_files / "a.jsonl"))
  with pytest.raises(ConfigError, match="grain_eval_files"):
    create_iterator(cfg, mesh_for(cfg), "eval")
  with pytest.raises(ConfigError, match="hf_eval_files"):
    create_iterator(config(dataset_type="hf", hf_path="json", hf_train_files=str(jsonl_files / "a.jsonl")), mesh_for(cfg), "eval")


def test_train_data_used_up_ends_the_iterator(jsonl_files):
  cfg = config(grain_train_files=str(jsonl_files / "a.jsonl"), packing=False)
  it = create_iterator(cfg, mesh_for(cfg))
  for _ in range(N_DOCS // 2 // 8):
    next(it)
  with pytest.raises(StopIteration):  # a normal end: the train loop saves the last step (tests/test_run_ends.py)
    next(it)


def test_worker_processes_give_same_batches_and_resume(jsonl_files):
  base = dict(grain_train_files=str(jsonl_files / "[ab].jsonl"), enable_data_shuffling=True, grain_prefetch_buffer_size=2, num_epoch=2)
  cfg = config(grain_worker_count=1, **base)
  mesh = mesh_for(cfg)
  inline = create_iterator(config(**base), mesh)
  it = create_iterator(cfg, mesh)
  try:
    for _ in range(2):
      np.testing.assert_array_equal(it.next_local()["inputs"], inline.next_local()["inputs"])
    state = json.loads(json.dumps(it.get_state()))
    want = [it.next_local()["inputs"] for _ in range(2)]
    it.set_state(state)
    for w in want:
      np.testing.assert_array_equal(it.next_local()["inputs"], w)
  finally:
    it.close()


def _prepare_tfds(data_dir):
  import tensorflow_datasets as tfds

  class MaxtextTinyText(tfds.core.GeneratorBasedBuilder):
    __module__ = "maxtext_tiny_text"  # a top-level module name keeps tfds from looking for package resources
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(0, 24), "validation": self._generate_examples(100, 6)}

    def _generate_examples(self, start, n):
      for i in range(start, start + n):
        yield i, {"text": doc_text(i)}

  MaxtextTinyText(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tfds")
  _prepare_tfds(path)
  return path


def test_tfds_local_prepared_data_without_tensorflow(tfds_dir):
  tmp_path = tfds_dir
  cfg = config(dataset_type="tfds", dataset_name="maxtext_tiny_text", dataset_path=str(tmp_path), packing=False, max_target_length=128)
  rows = rows_of(local(cfg))
  assert len(rows) == 24
  tok = load_tokenizer("sentencepiece", sp_model())
  assert sorted(tok.decode(r[1:-1]) for r in rows) == sorted(doc_text(i) for i in range(24))
  eval_batches = local(cfg, "eval")
  assert len(eval_batches) == 1 and len(rows_of(eval_batches)) == 6  # 6 documents, padded to a batch of 8 rows
  with pytest.raises(DataError, match="nope_ds"):
    local(config(dataset_type="tfds", dataset_name="nope_ds", dataset_path=str(tmp_path)))


def test_hf_streaming_json_and_resume(jsonl_files):
  files = str(jsonl_files / "[ab].jsonl")
  cfg = config(dataset_type="hf", hf_path="json", hf_train_files=files, hf_eval_files=str(jsonl_files / "eval.jsonl"), packing=True, num_epoch=2)
  mesh = mesh_for(cfg)
  it = create_iterator(cfg, mesh)
  check_row_invariants(it.next_local())
  state = json.loads(json.dumps(it.get_state()))
  want = [it.next_local() for _ in range(3)]
  it.set_state(state)
  for w in want:
    np.testing.assert_array_equal(it.next_local()["inputs"], w["inputs"])
  assert len(list(create_iterator(cfg, mesh, "eval"))) == 1


def test_embedded_corpus_trains_and_caches_tokenizer(tmp_path):
  cfg = config(dataset_type="embedded", tokenizer_path="", vocab_size=400, base_output_directory=str(tmp_path), use_truncation=False, max_target_length=64)
  it = create_iterator(cfg, mesh_for(cfg))
  check_row_invariants(it.next_local())
  cached = tmp_path / "tokenizers" / "pydoc_topics_sp400.model"
  assert cached.is_file()
  mtime = cached.stat().st_mtime_ns
  ev = create_iterator(cfg, mesh_for(cfg), "eval")
  assert cached.stat().st_mtime_ns == mtime, "the cached tokenizer is reused"
  train_rows, eval_rows = set(rows_of([it.next_local()])), set(rows_of([ev.next_local()]))
  assert not train_rows & eval_rows


def test_bos_eos_flags_and_joined_columns(tmp_path):
  tok = load_tokenizer("sentencepiece", sp_model())
  path = write_jsonl(tmp_path / "two.jsonl", [{"title": "doc 1", "text": "the model"}])
  for add_bos, add_eos in [(True, True), (False, True), (True, False), (False, False)]:
    cfg = config(grain_train_files=path, train_data_columns=["title", "text"], add_bos=add_bos, add_eos=add_eos, per_device_batch_size=0.125)
    (row,) = rows_of(local(cfg))
    want = [tok.bos_id] * add_bos + tok.encode("doc 1\nthe model") + [tok.eos_id] * add_eos
    assert list(row) == want


def test_tfds_eval_dataset_name(tfds_dir):
  cfg = config(
    dataset_type="tfds", dataset_name="nope_ds", eval_dataset_name="maxtext_tiny_text", dataset_path=str(tfds_dir), eval_split="train", packing=False
  )
  assert len(rows_of(local(cfg, "eval"))) == 24


def test_eval_batches_take_eval_per_device_batch_size_and_cover_the_same_tokens(tmp_path):
  """eval_per_device_batch_size=2 on 8 devices: eval batches of 16 rows (train batches keep 8), over exactly the tokens
  the default eval batches cover (the eval loss is token-weighted, so it does not depend on the batch size)."""
  path = write_jsonl(tmp_path / "docs.jsonl", [{"text": doc_text(i)} for i in range(40)])
  keys = dict(grain_train_files=path, grain_eval_files=path)
  default, larger = config(**keys), config(eval_per_device_batch_size=2, **keys)
  assert (default.global_batch_size_to_eval_on, larger.global_batch_size_to_eval_on, larger.global_batch_size_to_train_on) == (8, 16, 8)
  mesh = mesh_for(larger)
  assert next(create_iterator(larger, mesh))["inputs"].shape[0] == 8
  covered = []
  for cfg in (default, larger):
    it, batches = create_iterator(cfg, mesh, "eval"), []
    while (batch := next(it, None)) is not None:
      batches.append({k: np.asarray(v) for k, v in batch.items()})
    assert {b["inputs"].shape[0] for b in batches} == {cfg.global_batch_size_to_eval_on}
    covered.append(sorted(int(t) for b in batches for t in b["targets"][b["targets_segmentation"] > 0]))
  assert covered[0] == covered[1] and covered[0]
  with pytest.raises(ConfigError, match="eval_per_device_batch_size"):
    config(eval_per_device_batch_size=0.3, **keys)
