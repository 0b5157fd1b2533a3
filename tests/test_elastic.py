"""Elastic restarts: a run of 2 processes x 4 CPU devices restarted as 1 process (4 devices), then again as 2,
follows the uninterrupted run's data order with the same global batch (grain_use_elastic_iterator=true,
elastic_batch=keep), with grain worker counts 0 and 2: its losses match within 1e-5."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_multi_tier import losses, start, wait
from tests.test_multihost import grain_data

STEPS = 6
WORKERS = (0, 2)


def data_args(out: Path, workers: int) -> tuple[str, ...]:
  grain = {k: v for k, v in (a.split("=", 1) for a in grain_data(out))}
  grain.update(
    grain_worker_count=str(workers),
    enable_checkpointing="true",
    grain_use_elastic_iterator="true",
    checkpoint_period="2",
    learning_rate_schedule_steps=str(STEPS),
  )
  return tuple(f"{k}={v}" for k, v in grain.items())


def branch_at(out: Path, source: str, run_name: str, step: int) -> None:
  """run_name: a copy of run `source` as it stood after `step` steps (its checkpoint of that step, its metrics rows
  before it): the 2-process start of the elastic run, whose first steps are the uninterrupted run's."""
  shutil.copytree(out / source, out / run_name)
  for saved in (out / run_name / "checkpoints").iterdir():
    if saved.name.isdigit() and int(saved.name) > step:
      shutil.rmtree(saved)
  metrics = out / run_name / "metrics.jsonl"
  metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines() if json.loads(line)["step"] < step))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Phase 1: per worker count, the uninterrupted 2-process run (a checkpoint every 2 steps); the elastic run starts
  as its copy at step 2 (the same 2 processes, the same steps). Phase 2: the elastic runs continue on 1 process to
  step 4. Phase 3: on 2 processes to the end. The worker count changes only the input pipeline, so every phase runs
  one worker count after the other: the first compiles each program of the phase's layout, the second loads them
  from the shared compilation cache (run together, both compiled them: this file took 151 CPU s, now 141)."""
  out = tmp_path_factory.mktemp("elastic")
  args = {w: data_args(out, w) for w in WORKERS}
  one, two = {}, {}
  for w in WORKERS:
    done = wait({f"full{w}": start(out, f"full{w}", steps=STEPS, extra=args[w])})
    assert done[f"full{w}"][0] == [0, 0], done[f"full{w}"][1][-3000:]
    branch_at(out, f"full{w}", f"elastic{w}", 2)
  for w in WORKERS:
    one |= wait({f"elastic{w}": start(out, f"elastic{w}", processes=1, steps=4, extra=args[w])})
  for w in WORKERS:  # one resumed 2-process run at a time (see tests/test_multi_tier.py)
    two |= wait({f"elastic{w}": start(out, f"elastic{w}", steps=STEPS, extra=args[w])})
  for label, (codes, text) in ({f"{k}.one": v for k, v in one.items()} | {f"{k}.two": v for k, v in two.items()}).items():
    assert all(code == 0 for code in codes), f"{label}: {text[-3000:]}"
  return out, one, two


@pytest.mark.parametrize("workers", WORKERS)
def test_two_one_two_processes_follow_the_uninterrupted_data_order(runs, workers):
  out, one, two = runs
  said = one[f"elastic{workers}"][1]
  assert "elastic_batch=keep holds the global batch at 8 sequences (per_device_batch_size 1 -> 2)" in said, said[-3000:]
  assert "restored checkpoint at step 2" in said and "restored checkpoint at step 4" in two[f"elastic{workers}"][1]
  full, elastic = losses(out, f"full{workers}"), losses(out, f"elastic{workers}")
  assert sorted(full) == sorted(elastic) == list(range(STEPS))
  assert len(set(full.values())) == STEPS  # every step a different batch: a repeated or skipped batch would show
  for step in range(STEPS):
    assert elastic[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step


def test_elastic_batch_rule(tmp_path):
  """keep: the checkpoint's global batch, per_device_batch_size following the device count; scale: the configured
  per-device batch; the same device count: the config as it is."""
  from maxtext.config import ConfigError, from_overrides
  from maxtext.train import elastic

  step = tmp_path / "r" / "checkpoints" / "4"
  (step / "items").mkdir(parents=True)
  (step / "manifest").mkdir()
  (step / "manifest" / "metadata").write_text(json.dumps({"arrays": {}, "settings": {}, "layout": {"num_devices": 8, "global_batch_size_to_train_on": 8}}))
  said = []

  def config(devices: int, **kw):
    return from_overrides(num_devices=devices, base_output_directory=str(tmp_path), run_name="r", **{"per_device_batch_size": 1, **kw})

  kept = elastic.resume_batch(config(4), said.append)
  assert (kept.per_device_batch_size, kept.global_batch_size_to_train_on, kept.micro_batch_size_to_train_on) == (2, 8, 8)
  assert said[-1].endswith("elastic_batch=keep holds the global batch at 8 sequences (per_device_batch_size 1 -> 2)")
  scaled = elastic.resume_batch(config(4, elastic_batch="scale"), said.append)
  assert scaled.global_batch_size_to_train_on == 4 and "elastic_batch=scale" in said[-1]
  same = config(8, per_device_batch_size=2)
  assert elastic.resume_batch(same, said.append) is same  # the same device count: a changed batch is the user's
  with pytest.raises(ConfigError, match="gradient_accumulation_steps 3"):
    elastic.resume_batch(config(4, gradient_accumulation_steps=3), said.append)


def test_elastic_batch_scale_across_a_restart(tmp_path, monkeypatch, capsys):
  """elastic_batch=scale with the elastic iterator: 2 steps on 4 devices (global batch 4), resumed on 8 devices (global
  batch 8, per_device_batch_size as configured): the resumed run reads the rows that follow the saved global position,
  so the 4 + 4 + 8 + 8 rows the two runs trained on are the first 24 rows of the data in order, none repeated or skipped."""
  import numpy as np

  from maxtext.data import create_iterator
  from maxtext.data.iterator import DataIterator
  from maxtext.train.loop import train
  from tests.test_train_helpers import mesh_for, tiny_config

  grain = dict(a.split("=", 1) for a in grain_data(tmp_path))
  grain.update(enable_checkpointing="true", vocab_size="512")

  def config(devices: int, steps: int):
    return tiny_config(
      num_devices=devices,
      base_output_directory=str(tmp_path / "out"),
      run_name="scale",
      steps=steps,
      learning_rate_schedule_steps=4,
      checkpoint_period=2,
      grain_use_elastic_iterator=True,
      elastic_batch="scale",
      **grain,
    )

  trained = []
  next_local = DataIterator.next_local

  def recorded(self):
    batch = next_local(self)
    if self.split == "train":
      trained.extend(np.asarray(batch["inputs"]).tolist())
    return batch

  monkeypatch.setattr(DataIterator, "next_local", recorded)
  first = config(4, 2)
  train(first, mesh=mesh_for(first))
  assert len(trained) == 2 * 4
  capsys.readouterr()
  resumed = config(8, 4)
  train(resumed, mesh=mesh_for(resumed))
  said = capsys.readouterr().out
  assert "resuming on 8 devices a checkpoint trained on 4: the global batch is 8 sequences (checkpoint: 4; elastic_batch=scale)" in said, said[-2000:]
  assert "restored checkpoint at step 2" in said
  assert len(trained) == 2 * 4 + 2 * 8
  monkeypatch.setattr(DataIterator, "next_local", next_local)
  reference = create_iterator(first, mesh_for(first))
  rows = [row for _ in range(6) for row in np.asarray(reference.next_local()["inputs"]).tolist()]
  assert len({tuple(r) for r in rows}) == len(rows)  # distinct rows: a repeated or skipped one would show
  assert trained == rows
