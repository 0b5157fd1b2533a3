"""Weights & Biases (enable_wandb) in offline mode, checked by reading back the run files W&B writes: every metric of
the metrics file at every step, the resolved config, the training-curves image, and a resumed run appending to the
same W&B run id. The run trains on a data mixture, so its realised fractions are among the metrics."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import struct
from pathlib import Path

import pytest

from tests.test_data_common import doc_text, sp_model, write_jsonl
from tests.test_train_helpers import mesh_for, tiny_config

wandb = pytest.importorskip("wandb")

BLOCK = 32768  # W&B's transaction log: LevelDB-style blocks of records, after a 7-byte file header
FULL, LAST = 1, 4


def read_records(path: str) -> list:
  """The protobuf records of a W&B `.wandb` file (a LevelDB log: per record crc32, length, type; 32 KiB blocks)."""
  from wandb.proto import wandb_internal_pb2 as pb

  data = Path(path).read_bytes()
  assert data[:4] == b":W&B"
  pos, buf, out = 7, b"", []
  while pos + 7 <= len(data):
    left = BLOCK - pos % BLOCK
    if left < 7:  # a block's tail too short for a header is padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    if kind == 0:
      pos += left
      continue
    buf += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (FULL, LAST):
      record = pb.Record()
      record.ParseFromString(buf)
      out.append(record)
      buf = b""
  return out


def history(records) -> dict[int, dict]:
  """step -> {metric: value} of the history records."""
  out: dict[int, dict] = {}
  for r in records:
    if r.WhichOneof("record_type") == "history":
      items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
      out.setdefault(int(items["_step"]), {}).update(items)
  return out


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
  """Steps 0-3 (checkpoint at 4), then the same command with steps=6 resumes at 4; both with W&B offline."""
  tmp = tmp_path_factory.mktemp("wandb")
  for name, offset in (("web", 0), ("code", 500)):
    write_jsonl(tmp / f"{name}.jsonl", [{"text": doc_text(offset + i)} for i in range(60)])
  write_jsonl(tmp / "eval.jsonl", [{"text": doc_text(900 + i)} for i in range(4)])
  env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp / "wb"), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
  env.update({k: str(tmp / k.lower()) for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")})
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  (tmp / "wb").mkdir()
  from maxtext.train import setup as setup_lib
  from maxtext.train.loop import train

  def config(steps: int):
    return tiny_config(
      num_devices=1,
      per_device_batch_size=2,
      dataset_type="grain",
      grain_file_type="jsonl",
      grain_train_files=f"{tmp}/web.jsonl,0.7;{tmp}/code.jsonl,0.3",
      grain_eval_files=str(tmp / "eval.jsonl"),
      tokenizer_type="sentencepiece",
      tokenizer_path=sp_model(),
      vocab_size=512,
      max_target_length=32,
      grain_worker_count=0,
      steps=steps,
      learning_rate_schedule_steps=6,
      checkpoint_period=2,
      eval_interval=4,
      eval_steps=1,
      enable_tensorboard=True,
      enable_wandb=True,
      wandb_project_name="mixwandb-test",
      metrics_file=str(tmp / "metrics.jsonl"),
      base_output_directory=str(tmp / "out"),
      run_name="wb",
    )

  try:
    first = config(4)
    setup = setup_lib.build(first, mesh_for(first))
    assert train(first, setup=setup).steps_done == 4
    second = config(6)
    assert train(second, setup=setup).steps_done == 6
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  runs = sorted(glob.glob(str(tmp / "wb" / "wandb" / "offline-run-*")))
  return tmp, second, runs


def test_offline_files_hold_every_metric_at_every_step(two_runs):
  tmp, config, runs = two_runs
  assert len(runs) == 2
  logged: dict[int, dict] = {}
  for line in (tmp / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    logged.setdefault(row.pop("step"), {}).update(row)
  assert sorted(logged) == list(range(6)) and "eval_loss" in logged[3]
  assert {"data/web_fraction", "data/code_fraction"} <= set(logged[0])  # the mixture's realised fractions
  seen = {}
  for run in runs:
    (wandb_file,) = glob.glob(f"{run}/run-*.wandb")
    seen.update(history(read_records(wandb_file)))
  for step, metrics in logged.items():
    for key, value in metrics.items():
      if isinstance(value, float) and math.isfinite(value):
        assert seen[step][f"learning/{key}"] == pytest.approx(value, rel=1e-6), (step, key)


def test_resumed_run_appends_to_the_same_run_id_with_config_and_curves(two_runs):
  tmp, config, runs = two_runs
  run_id = (tmp / "out" / "wb" / "wandb_run_id").read_text().strip()
  steps = []
  for run in runs:
    (wandb_file,) = glob.glob(f"{run}/run-*.wandb")
    assert wandb_file.endswith(f"run-{run_id}.wandb")
    records = read_records(wandb_file)
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert meta.run_id == run_id and meta.project == "mixwandb-test" and meta.display_name == "wb"
    values = {u.key: json.loads(u.value_json) for u in meta.config.update}
    assert values["grain_train_files"] == config.grain_train_files and values["checkpoint_period"] == 2
    steps.append(sorted(history(records)))
  assert steps == [[0, 1, 2, 3], [4, 5]]  # the second process logs from its restored step on
  last = history(read_records(glob.glob(f"{runs[1]}/run-*.wandb")[0]))
  image = next(v for step in last.values() for k, v in step.items() if k == "training_curves/path")
  assert os.path.isfile(os.path.join(runs[1], "files", image))  # the run's training_curves.png, uploaded with the run


def test_enable_wandb_without_the_package_is_a_config_error(monkeypatch):
  from maxtext.errors import ConfigError

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(ConfigError, match="enable_wandb=true needs the wandb package"):
    tiny_config(enable_wandb=True)
