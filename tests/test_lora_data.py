"""Several LoRA adapters trained from data: lora.adapter_column names each document's adapter, the pipeline
carries per-token adapter_ids through truncation, chunking and packing, and one step trains every adapter in it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from maxtext.config import ConfigError
from maxtext.data import features, pipeline
from maxtext.errors import DataError
from maxtext.tokenizer import load_tokenizer
from maxtext.train import setup as setup_lib
from maxtext.train.__main__ import main
from maxtext.train.loop import train
from tests.test_data_common import config as data_config
from tests.test_data_common import doc_text, sp_model, write_jsonl
from tests.test_train_helpers import TINY, mesh_for, tiny_config

NAMES = ["alice", "bob:1", "carol"]
MULTI = {"lora.enable_lora": True, "lora.lora_rank": 2, "lora.max_lora_adapters": 3, "lora.lora_adapters": NAMES, "lora.adapter_column": "adapter"}


def _adapter(i: int) -> str | int:
  """Documents alternate between alice (by name) and bob (by slot number); carol gets none."""
  return "alice" if i % 2 == 0 else 1


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("lora_data")
  write_jsonl(d / "train.jsonl", [{"text": doc_text(i), "adapter": _adapter(i)} for i in range(48)])
  write_jsonl(d / "bad.jsonl", [{"text": doc_text(0), "adapter": "alice"}, {"text": doc_text(1), "adapter": "dave"}])
  return d


def _lora_data_config(data_dir, **overrides):
  nested = {k.split(".", 1)[1]: v for k, v in MULTI.items()}
  kw = dict(grain_train_files=str(data_dir / "train.jsonl"), lora=nested)
  return data_config(**{**kw, **overrides})


def _expected_slots(cfg) -> dict[tuple[int, ...], int]:
  """Each document's tokens -> its adapter slot (from encoding it alone)."""
  encoder = pipeline.make_encoder(cfg, load_tokenizer("sentencepiece", sp_model()))
  out = {}
  for i in range(48):
    doc = encoder.encode({"text": doc_text(i), "adapter": _adapter(i)}, f"doc {i}")
    out[tuple(doc["tokens"][: cfg.max_target_length].tolist())] = 0 if i % 2 == 0 else 1
  return out


def _batches(cfg):
  ds, _ = pipeline.local_batches(cfg, "train", 0, 1, cfg.global_batch_size_to_train_on)
  return [{k: np.asarray(v) for k, v in b.items()} for b in ds]


@pytest.mark.parametrize("packing", [True, False])
def test_adapter_ids_follow_documents_through_packing_and_padding(data_dir, packing):
  cfg = _lora_data_config(data_dir, packing=packing, max_target_length=64)
  expected = _expected_slots(cfg)
  batches = _batches(cfg)
  seen = set()
  mixed_rows = 0
  for b in batches:
    assert b[features.ADAPTER_KEY].shape == b["inputs"].shape and b[features.ADAPTER_KEY].dtype == np.int32
    for r in range(b["inputs"].shape[0]):
      seg, ids = b["inputs_segmentation"][r], b[features.ADAPTER_KEY][r]
      assert (ids[seg == 0] == features.NO_ADAPTER).all()  # padding runs on the base model
      slots = set()
      for s in np.unique(seg[seg > 0]):
        tokens = tuple(b["inputs"][r][seg == s].tolist())
        assert (ids[seg == s] == expected[tokens]).all()
        slots.add(expected[tokens])
        seen.add(tokens)
      mixed_rows += len(slots) > 1
  assert len(seen) >= 40  # a last partial batch is dropped
  assert mixed_rows > 0 if packing else mixed_rows == 0  # packed rows mix documents of both adapters


def test_adapter_ids_follow_chunks(data_dir):
  cfg = _lora_data_config(data_dir, packing=False, use_truncation=False, max_target_length=8)
  encoder = pipeline.make_encoder(cfg, load_tokenizer("sentencepiece", sp_model()))
  rows = []
  for i in range(48):
    doc = encoder.encode({"text": doc_text(i), "adapter": _adapter(i)}, f"doc {i}")
    for row in features.chunk(doc, 8):
      rows.append((row["inputs"].tolist(), 0 if i % 2 == 0 else 1))
      np.testing.assert_array_equal(row[features.ADAPTER_KEY], np.full(len(row["inputs"]), rows[-1][1]))
  got = []
  for b in _batches(cfg):
    for r in range(b["inputs"].shape[0]):
      used = b["inputs_segmentation"][r] > 0
      assert len(set(b[features.ADAPTER_KEY][r][used].tolist())) == 1
      got.append((b["inputs"][r][used].tolist(), int(b[features.ADAPTER_KEY][r][0])))
  assert got == rows[: len(got)] and len(got) > 48


def test_unknown_adapter_in_data_is_one_line_error(data_dir, tmp_path, capsys):
  cfg = _lora_data_config(data_dir, grain_train_files=str(data_dir / "bad.jsonl"))
  with pytest.raises(DataError, match=r"bad.jsonl line 2 names adapter 'dave' in column 'adapter'.*\['alice', 'bob', 'carol'\]"):
    _batches(cfg)


def test_column_is_checked(data_dir, tmp_path, capsys):
  with pytest.raises(ConfigError, match="lora.adapter_column"):
    data_config(lora={"enable_lora": True, "adapter_column": "adapter"})
  args = [f"{k}={v}" for k, v in {**TINY, "base_output_directory": str(tmp_path), "run_name": "r"}.items()]
  multi = [f"{k}={v}".replace("'", '"') for k, v in MULTI.items() if k != "lora.adapter_column"]
  with pytest.raises(SystemExit) as exit_info:
    main(["configs/base.yml", *args, *multi])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "set lora.adapter_column" in err[0]


def _slots(params) -> dict[str, np.ndarray]:
  return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params) if "lora_" in str(p[-1])}


def test_two_adapters_train_from_data_and_the_third_stays(data_dir, tmp_path):
  nested = {k.split(".", 1)[1]: v for k, v in MULTI.items()}
  cfg = tiny_config(
    num_devices=1,
    per_device_batch_size=4,
    dataset_type="grain",
    grain_file_type="jsonl",
    grain_train_files=str(data_dir / "train.jsonl"),
    tokenizer_type="sentencepiece",
    tokenizer_path=sp_model(),
    vocab_size=512,
    max_target_length=32,
    grain_worker_count=0,
    grain_prefetch_buffer_size=0,
    steps=2,
    adam_weight_decay=0.0,  # decay would shrink every slot's A, trained or not
    enable_checkpointing=False,
    base_output_directory=str(tmp_path),
    run_name="multi",
    lora={**nested, "lora_module_path": "attention/query$|mlp/wo$"},  # two adapted projections per layer: a smaller compile
  )
  setup = setup_lib.build(cfg, mesh_for(cfg))
  before = _slots(jax.device_get(setup.init_state()["params"]))
  result = train(cfg, setup=setup)
  assert result.steps_done == 2 and all(np.isfinite(v) for v in result.losses.values())
  after = _slots(jax.device_get(result.state["params"]))
  assert before.keys() == after.keys() and before
  slot_axis = 1 if cfg.scan_layers else 0  # [layers, slots, ...] when the layers are stacked
  for name, a in after.items():
    b = before[name]
    moved = [not np.array_equal(np.take(a, s, axis=slot_axis), np.take(b, s, axis=slot_axis)) for s in range(3)]
    if name.endswith("lora_b"):  # B starts at zero: the data's two adapters learn, carol (in no document) stays
      assert moved == [True, True, False], name
    else:
      assert not moved[2], name


def test_decode_serves_several_adapters_in_one_batch():
  from maxtext.inference.generate import Generator
  from maxtext.inference.sampling import SamplingParams
  from tests.test_decode import perturbed
  from tests.test_models import tiny

  nested = {k.split(".", 1)[1]: v for k, v in MULTI.items() if k != "lora.adapter_column"}
  lora = {**nested, "lora_module_path": "attention/query$|mlp/wo$"}
  cfg = tiny(dtype="float32", matmul_precision="highest", lora=lora, max_target_length=20, max_prefill_predict_length=8)
  gen = Generator(perturbed(cfg, seed=3), SamplingParams(strategy="greedy"), config=cfg)
  prompts = [[5, 9, 2, 7], [11, 3, 8]]
  gen.compile(batch=2, prompt_length=4, adapters=True)  # what generate(..., adapter_ids=...) runs, compiled ahead
  mixed = gen.generate(prompts, adapter_ids=["alice", 1]).tokens
  alice = gen.generate(prompts, adapter_ids=["alice", "alice"]).tokens
  bob = gen.generate(prompts, adapter_ids=[1, "bob"]).tokens
  assert mixed == [alice[0], bob[1]]
  assert gen.generate(prompts[:1], adapter_ids=["alice"]).tokens == [alice[0]]  # alone, in a batch of one
  assert alice != bob  # the adapters differ, so the routing is what made the rows agree
  assert gen.generate(prompts).tokens == alice  # no ids: slot 0 for every row
  with pytest.raises(DataError, match="adapter 'dave' of prompt 1"):
    gen.generate(prompts, adapter_ids=["alice", "dave"])


def test_decode_lora_adapter_key_is_checked():
  from maxtext.inference.cli import check_adapter
  from tests.test_models import tiny

  nested = {k.split(".", 1)[1]: v for k, v in MULTI.items() if k != "lora.adapter_column"}
  assert check_adapter(tiny(lora=nested, decode_lora_adapter="bob")) == ["bob"]
  assert check_adapter(tiny(lora=nested)) is None
  with pytest.raises(ConfigError, match=r"'dave' is not one of the adapters \['alice', 'bob', 'carol'\]"):
    check_adapter(tiny(lora=nested, decode_lora_adapter="dave"))
  with pytest.raises(ConfigError, match="lora.max_lora_adapters > 1"):
    check_adapter(tiny(decode_lora_adapter="bob"))
