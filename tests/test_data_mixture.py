"""Data mixtures (MaxText's `glob,weight;glob,weight` and JSON mixture config): parsing, realised proportions,
per-process determinism, exact resume, exhaustion, the HF and Parquet sources, and bad input as the user meets it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from maxtext.data import create_iterator, features, mixture, pipeline
from maxtext.errors import ConfigError, DataError
from tests.test_bad_inputs import _run_case, _train
from tests.test_data_common import config, doc_text, mesh_for, sp_model, write_jsonl

SIZES = {"web": 40, "code": 24, "math": 16}  # documents per component
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
  d = tmp_path_factory.mktemp("mixture")
  for k, (name, size) in enumerate(SIZES.items()):
    write_jsonl(d / f"{name}.jsonl", [{"text": doc_text(1000 * k + i)} for i in range(size)])
  return d


def spec(d: Path, weights: dict[str, float] = WEIGHTS) -> str:
  return ";".join(f"{d / name}.jsonl,{w}" for name, w in weights.items())


def counts_of(batches) -> np.ndarray:
  """Documents per component (index 0 = the first) in local batches that carry features.MIXTURE_KEY."""
  total = np.zeros(len(SIZES) + 1, np.int64)
  for b in batches:
    total += np.bincount(np.asarray(b[features.MIXTURE_KEY]).ravel(), minlength=len(SIZES) + 1)
  return total[1:]


def test_syntax_names_and_weights(files, tmp_path):
  found = mixture.components(config(grain_train_files=spec(files)), "train")
  assert [(c.name, c.weight) for c in found] == list(WEIGHTS.items())
  assert mixture.components(config(grain_train_files=str(files / "web.jsonl")), "train") == []  # no ';': one source
  hf = mixture.components(config(dataset_type="hf", hf_path="json", hf_train_files=spec(files)), "train")
  assert [c.name for c in hf] == list(WEIGHTS)
  same = mixture.components(config(grain_train_files=f"{files}/web.jsonl,1;{files}/sub/web.jsonl,1"), "train")
  assert [c.name for c in same] == ["web", "component1"]  # a taken name falls back to the position
  path = tmp_path / "mix.json"
  path.write_text(json.dumps({"wiki-en": {"path": str(files / "web.jsonl"), "weight": 3}, "code": {"path": str(files / "code.jsonl"), "weight": 1}}))
  found = mixture.components(config(grain_train_mixture_config_path=str(path), grain_train_files="ignored"), "train")
  assert [(c.name, c.weight) for c in found] == [("wiki-en", 3.0), ("code", 1.0)]


@pytest.mark.parametrize(
  "value, message",
  [
    ("{d}/web.jsonl;{d}/code.jsonl,1", "has no weight"),
    ("{d}/web.jsonl,x;{d}/code.jsonl,1", "has weight 'x'"),
    ("{d}/web.jsonl,-1;{d}/code.jsonl,2", "has weight '-1'"),
    ("{d}/web.jsonl,nan;{d}/code.jsonl,1", "finite weight"),
    ("{d}/web.jsonl,0;{d}/code.jsonl,0", "sum to 0"),
  ],
)
def test_bad_weights_are_config_errors(files, value, message):
  with pytest.raises(ConfigError, match=message):
    mixture.components(config(grain_train_files=value.format(d=files)), "train")


@pytest.mark.parametrize(
  "content, message",
  [("not json", "not valid JSON"), ("[]", "non-empty JSON object"), ('{"a": {"path": "x"}}', "must be"), ('{"a b": {"path": "x", "weight": 1}}', "rename it")],
)
def test_bad_mixture_config_file(tmp_path, content, message):
  path = tmp_path / "mix.json"
  path.write_text(content)
  with pytest.raises(ConfigError, match=message):
    mixture.components(config(grain_train_mixture_config_path=str(path)), "train")


def test_eval_files_take_no_weights(files):
  with pytest.raises(ConfigError, match="grain_eval_files is a weighted mixture"):
    mixture.components(config(grain_eval_files=spec(files)), "eval")


def test_fractions_over_2000_batches_match_the_weights(files):
  """3-way 0.5/0.3/0.2 mixture, small components reused (repeat): each realised fraction within 0.02 of its weight."""
  cfg = config(grain_train_files=spec(files), mixture_exhaustion="repeat", num_epoch=10_000, packing=False, max_target_length=16)
  ds, description = pipeline.local_batches(cfg, "train", 0, 1, 4)
  assert description.startswith("mixture of web (0.5), code (0.3), math (0.2)")
  it = iter(ds)
  batches = [next(it) for _ in range(2000)]
  counts = counts_of(batches)
  assert counts.sum() == 2000 * 4  # one document per row
  fractions = counts / counts.sum()
  for got, want in zip(fractions, WEIGHTS.values()):
    assert abs(got - want) <= 0.02, fractions
  again = next(iter(pipeline.local_batches(cfg, "train", 0, 1, 4)[0]))
  np.testing.assert_array_equal(again["inputs"], batches[0]["inputs"])  # deterministic for the seed
  other_seed = next(iter(pipeline.local_batches(cfg.model_copy(update={"data_shuffle_seed": 5}), "train", 0, 1, 4)[0]))
  assert not np.array_equal(other_seed["inputs"], batches[0]["inputs"])


def test_each_process_draws_its_own_share(files):
  cfg = config(grain_train_files=spec(files), packing=False, max_target_length=16, per_device_batch_size=0.5)
  shares = [list(pipeline.local_batches(cfg, "train", p, 2, 2)[0]) for p in (0, 1)]
  rows = [{tuple(b["inputs"][r]) for b in share for r in range(len(b["inputs"]))} for share in shares]
  assert rows[0] and rows[1] and not rows[0] & rows[1]  # disjoint records


def test_stop_ends_the_data_when_a_component_runs_out(files):
  cfg = config(grain_train_files=spec(files, {"web": 0.2, "code": 0.2, "math": 0.6}), packing=False, max_target_length=16)
  counts = counts_of(pipeline.local_batches(cfg, "train", 0, 1, 1)[0])
  assert counts[2] == SIZES["math"] and counts[0] < SIZES["web"] and counts[1] < SIZES["code"]  # math ran out first and ended it
  twice = counts_of(pipeline.local_batches(cfg.model_copy(update={"num_epoch": 2}), "train", 0, 1, 1)[0])
  assert twice[2] == 2 * SIZES["math"]
  repeat = cfg.model_copy(update={"mixture_exhaustion": "repeat"})
  counts = counts_of(pipeline.local_batches(repeat, "train", 0, 1, 1)[0])
  assert counts[2] > SIZES["math"] and counts[0] >= SIZES["web"] and counts[1] >= SIZES["code"]  # ends once every component had its pass


def test_resume_gives_exactly_the_uninterrupted_batches_and_counts(files):
  cfg = config(
    grain_train_files=spec(files),
    mixture_exhaustion="repeat",
    num_epoch=50,
    enable_data_shuffling=True,
    data_shuffle_seed=3,
    use_truncation=False,
    packing=True,
    grain_prefetch_buffer_size=2,
  )
  mesh = mesh_for(cfg)
  it = create_iterator(cfg, mesh)
  for _ in range(12):  # past the end of the smallest component's first pass
    it.next_local()
  state = json.loads(json.dumps(it.get_state()))
  assert list(state["mixture_counts"]) == list(SIZES)
  want = [it.next_local() for _ in range(6)]
  want_metrics = it.mixture_metrics()
  assert set(want_metrics) == {f"data/{n}_fraction" for n in SIZES} and abs(sum(want_metrics.values()) - 1) < 1e-9
  resumed = create_iterator(cfg, mesh)
  resumed.set_state(state)
  for w in want:
    got = resumed.next_local()
    assert features.MIXTURE_KEY not in got  # counted, then dropped: the train step never sees it
    for k in features.BATCH_KEYS:
      np.testing.assert_array_equal(got[k], w[k])
  assert resumed.mixture_metrics() == want_metrics
  unmixed = create_iterator(config(grain_train_files=str(files / "web.jsonl")), mesh)
  with pytest.raises(DataError, match="resume with the data settings"):
    unmixed.set_state(state)


def test_hf_and_parquet_mixtures_resume(files, tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  for name, size in SIZES.items():
    pq.write_table(pa.table({"text": [doc_text(7000 + i) for i in range(size)]}), tmp_path / f"{name}.parquet", row_group_size=5)
  for cfg in (
    config(dataset_type="hf", hf_path="json", hf_train_files=spec(files), packing=False, max_target_length=16, mixture_exhaustion="repeat", num_epoch=3),
    config(
      grain_file_type="parquet",
      grain_train_files=";".join(f"{tmp_path / n}.parquet,{w}" for n, w in WEIGHTS.items()),
      packing=False,
      max_target_length=16,
      enable_data_shuffling=True,
      grain_shuffle_buffer_size=4,
    ),
  ):
    it = create_iterator(cfg, mesh_for(cfg))
    for _ in range(3):
      it.next_local()
    state = json.loads(json.dumps(it.get_state()))
    want = [it.next_local()["inputs"] for _ in range(3)]
    assert min(it.mixture_metrics().values()) > 0  # every component drawn
    it.set_state(state)
    for w in want:
      np.testing.assert_array_equal(it.next_local()["inputs"], w)


def test_json_mixture_config_names_the_metrics(files, tmp_path):
  path = tmp_path / "mix.json"
  path.write_text(json.dumps({"wiki-en": {"path": str(files / "web.jsonl"), "weight": 1}, "maths": {"path": str(files / "m*.jsonl"), "weight": 1}}))
  cfg = config(grain_train_mixture_config_path=str(path), packing=False, max_target_length=16)
  it = create_iterator(cfg, mesh_for(cfg))
  it.next_local()
  metrics = it.mixture_metrics()
  assert list(metrics) == ["data/wiki-en_fraction", "data/maths_fraction"] and sum(metrics.values()) == pytest.approx(1)
  assert "grain_train_mixture_config_path" in it.description


def test_component_that_yields_nothing_is_a_data_error(files, tmp_path):
  write_jsonl(tmp_path / "empty.jsonl", [{"text": "  "}] * 3)
  cfg = config(grain_train_files=f"{files}/web.jsonl,1;{tmp_path}/empty.jsonl,1", packing=False, max_target_length=16)
  with pytest.raises(DataError, match="mixture component 'empty' yields no document"):
    create_iterator(cfg, mesh_for(cfg))


MIX = ("dataset_type=grain", "grain_file_type=jsonl", "tokenizer_path={sp}", "vocab_size=512")


@pytest.mark.parametrize(
  "argv, mention",
  [
    (_train(*MIX, "grain_train_files={tmp}/a.jsonl,0;{tmp}/b.jsonl,0"), "sum to 0"),
    (_train(*MIX, "grain_train_files={tmp}/a.jsonl,0.7;{tmp}/none/*.jsonl,0.3"), "component 'none' '"),
  ],
  ids=["weights_sum_to_zero", "component_without_files"],
)
def test_bad_mixture_is_one_line_exit_2_nothing_written(tmp_path, argv, mention):
  case = tmp_path / "case"
  case.mkdir()
  for name in ("a", "b"):
    write_jsonl(case / f"{name}.jsonl", [{"text": doc_text(i)} for i in range(8)])
  proc, before, after = _run_case(argv, case, tmp_path / "no_run", sp_model())
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  assert mention in lines[0] and "Traceback" not in proc.stdout + proc.stderr
  assert after == before
