"""Bad input: one-line errors naming the cause, raised before training where possible, data files never modified."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from maxtext.data import create_iterator
from maxtext.errors import ConfigError, DataError, UserError
from tests.test_data_common import config, doc_text, mesh_for, write_jsonl

REPO = Path(__file__).resolve().parents[1]


def make(cfg, split="train"):
  return create_iterator(cfg, mesh_for(cfg), split)


def one_line(e: pytest.ExceptionInfo) -> str:
  message = str(e.value)
  assert "\n" not in message and isinstance(e.value, UserError)
  return message


def digest(path) -> str:
  return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_empty_glob_and_missing_file(tmp_path):
  with pytest.raises(DataError, match="matches no file") as e:
    make(config(grain_train_files=str(tmp_path / "*.jsonl")))
  assert "grain_train_files" in one_line(e)
  with pytest.raises(DataError, match="missing.parquet' matches no file"):
    make(config(grain_train_files=str(tmp_path / "missing.parquet"), grain_file_type="parquet"))
  with pytest.raises(ConfigError, match="grain_train_files is empty"):
    make(config(grain_train_files=""))


def test_missing_and_non_text_columns(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [{"body": doc_text(i), "n": i} for i in range(20)])
  with pytest.raises(DataError, match=r"d.jsonl line 1: no column 'text' \(columns: body, n\)") as e:
    make(config(grain_train_files=path))
  assert "train_data_columns" in one_line(e)
  with pytest.raises(DataError, match=r"d.jsonl line 1: column 'n' is not text \(int\)"):
    make(config(grain_train_files=path, train_data_columns=["n"]))


def test_empty_document_set(tmp_path):
  path = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": "   "}, "", {"text": None}])
  with pytest.raises(DataError, match="yields no batch") as e:
    make(config(grain_train_files=path))
  assert "empty.jsonl" in one_line(e)
  blank = tmp_path / "blank.jsonl"
  blank.write_text("\n\n")
  with pytest.raises(DataError, match="yields no batch"):
    make(config(grain_train_files=str(blank)))


def test_malformed_line_stops_when_read_and_names_file_and_line(tmp_path):
  rows = [{"text": doc_text(i)} for i in range(40)]
  rows.insert(30, '{"text": "broken')
  path = write_jsonl(tmp_path / "broken.jsonl", rows)
  before = digest(path)
  it = make(config(grain_train_files=path, packing=False))  # the first batches are fine
  with pytest.raises(DataError, match=r"broken.jsonl line 31: malformed JSON") as e:
    for _ in range(10):
      next(it)
  one_line(e)
  assert digest(path) == before


def test_train_cli_exits_2_before_any_step(tmp_path):
  from tests.test_data_common import sp_model

  path = write_jsonl(tmp_path / "d.jsonl", [{"text": doc_text(0)}, {"text": 5}])
  before = digest(path)
  args = [
    "configs/quickstart.yml",
    f"base_output_directory={tmp_path / 'out'}",
    "dataset_type=grain",
    "grain_file_type=jsonl",
    f"grain_train_files={path}",
    f"tokenizer_path={sp_model()}",
    "vocab_size=512",
    "base_emb_dim=32",
    "base_mlp_dim=64",
    "base_num_decoder_layers=1",
    "base_num_query_heads=2",
    "base_num_kv_heads=2",
    "head_dim=16",
    "per_device_batch_size=1",
  ]
  env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
  proc = subprocess.run([sys.executable, "-m", "maxtext.train", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "d.jsonl line 2: column 'text' is not text (int)" in last
  assert "completed step" not in proc.stdout + proc.stderr
  assert digest(path) == before
