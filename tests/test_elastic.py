"""Elastic restarts: a run of 2 processes x 4 CPU devices restarted as 1 process (4 devices), then again as 2,
follows the uninterrupted run's data order with the same global batch (grain_use_elastic_iterator=true,
elastic_batch=keep), with grain worker counts 0 and 2: its losses match within 1e-5."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Phase 1: per worker count, the uninterrupted 2-process run and 2 steps of the elastic run. Phase 2: the elastic
  runs continue on 1 process to step 4. Phase 3: on 2 processes to the end."""
  out = tmp_path_factory.mktemp("elastic")
  args = {w: data_args(out, w) for w in WORKERS}
  done = wait(
    {f"full{w}": start(out, f"full{w}", steps=STEPS, extra=args[w]) for w in WORKERS}
    | {f"elastic{w}": start(out, f"elastic{w}", steps=2, extra=args[w]) for w in WORKERS}
  )
  one = wait({f"elastic{w}": start(out, f"elastic{w}", processes=1, steps=4, extra=args[w]) for w in WORKERS})
  two = {}
  for w in WORKERS:  # one resumed 2-process run at a time (see tests/test_multi_tier.py)
    two |= wait({f"elastic{w}": start(out, f"elastic{w}", steps=STEPS, extra=args[w])})
  for label, (codes, text) in (done | {f"{k}.one": v for k, v in one.items()} | {f"{k}.two": v for k, v in two.items()}).items():
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
