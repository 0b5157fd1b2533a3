"""What a new user meets: relative paths, the platform choice, the run's story, MFU, plots and eval-only."""

from __future__ import annotations

import json
import math
import os

import pytest

from maxtext import platform, plot
from maxtext.config import from_overrides
from maxtext.eval import evaluate
from maxtext.train import perf
from maxtext.train.loop import train
from maxtext.train.run_report import count, duration
from tests.test_train_helpers import mesh_for, tiny_config


def test_local_paths_become_absolute_and_uris_stay(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  c = from_overrides(
    base_output_directory="out",
    run_name="r",
    tokenizer_path="~/tok.model",
    grain_train_files="data/*.arrayrecord, gs://bucket/train-*",
    load_parameters_path="gs://bucket/params",
    lora={"lora_restore_path": "adapters"},
    num_devices=1,
  )
  assert c.base_output_directory == str(tmp_path / "out")
  assert c.checkpoint_dir == str(tmp_path / "out" / "r" / "checkpoints") + os.sep
  assert c.tokenizer_path == os.path.expanduser("~/tok.model")
  assert c.grain_train_files == f"{tmp_path}/data/*.arrayrecord,gs://bucket/train-*"
  assert c.load_parameters_path == "gs://bucket/params" and c.metrics_file == ""
  assert c.lora.lora_restore_path == str(tmp_path / "adapters")
  assert from_overrides(base_output_directory="", run_name="r", num_devices=1).checkpoint_dir == str(tmp_path / "r" / "checkpoints") + os.sep  # MaxText's ''
  assert from_overrides(base_output_directory="gs://b/runs", run_name="r", num_devices=1).checkpoint_dir == "gs://b/runs/r/checkpoints/"


def test_platform_choice_keeps_jax_off_tpu_without_chips():
  env: dict[str, str] = {}
  assert platform.choose_platform(env, tpu_chips=False, cuda=False) == "cpu" and env["JAX_PLATFORMS"] == "cpu"
  assert platform.choose_platform({}, tpu_chips=False, cuda=True) == "cuda,cpu"
  assert platform.choose_platform({}, tpu_chips=True, cuda=False) is None  # TPU VM: JAX picks the TPU
  mine = {"JAX_PLATFORMS": "tpu"}
  assert platform.choose_platform(mine, tpu_chips=False, cuda=False) is None and mine == {"JAX_PLATFORMS": "tpu"}


def test_measured_yardstick_is_raised_by_a_faster_step_so_mfu_stays_at_most_one():
  measured = perf.Yardstick(0.1, perf.MEASURED, measured=True)
  assert measured.mfu(0.05) == pytest.approx(0.5)
  assert measured.mfu(0.2) == 1.0 and measured.tflops == 0.2  # the device just showed 0.2 TFLOP/s
  assert measured.mfu(0.1) == pytest.approx(0.5)
  table = perf.Yardstick(1.0, "chip table")
  assert table.mfu(0.5) == 0.5 and table.tflops == 1.0


def test_readable_numbers():
  assert [duration(s) for s in (3, 187, 7500)] == ["3s", "3m07s", "2h05m"]
  assert [count(n) for n in (512, 8192, 10_200_000)] == ["512", "8.19K", "10.2M"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A tiny synthetic run with evals, TensorBoard and checkpoints; its printed story."""
  import contextlib
  import io

  out = tmp_path_factory.mktemp("run")
  config = tiny_config(
    num_devices=1, base_output_directory=str(out), run_name="story", steps=4, log_period=2, eval_interval=2, eval_steps=2, enable_tensorboard=True
  )
  buffer = io.StringIO()
  with contextlib.redirect_stdout(buffer):
    result = train(config, mesh=mesh_for(config))
  return config, result, buffer.getvalue()


def test_run_story_banner_progress_and_summary(finished_run):
  config, result, log = finished_run
  lines = log.splitlines()
  assert lines[0].startswith("model: ") and "parameters" in lines[0]
  assert any(line.startswith("mesh: ") for line in lines[:5]) and any("tokens per step" in line for line in lines[:5])
  assert any(line.startswith("output: ") and "tensorboard --logdir" in line for line in lines[:5])
  remat = "remat: full; each layer's saved input in device memory (decoder_layer_input=auto: offloading is tried only for scanned layers on TPU)"
  assert remat in lines[:5]
  assert "progress: 2/4 steps (50%)" in log and "ETA" in log
  assert sum(line.startswith("completed step: ") for line in lines) == 4  # MaxText's per-step line, unchanged
  assert "run story completed in" in log and "final train loss" in log and "eval loss" in log
  assert f"checkpoint: {config.checkpoint_dir}4" in log and "resume: rerun the same command" in log
  png = os.path.join(config.base_output_directory, "story", plot.RUN_PNG)
  assert f"plot: {png}" in log and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_reads_run_dirs_and_metrics_files_and_overlays(finished_run, tmp_path):
  config, result, _ = finished_run
  series = plot.read_run(os.path.join(config.base_output_directory, "story"))
  assert sorted(series["loss"]) == [0, 1, 2, 3] and series["loss"][3] == pytest.approx(result.losses[3], rel=1e-6)
  assert sorted(series["eval_loss"]) == [1, 3] and set(series) >= {"lr", "grad_norm", "tokens_per_device"}
  metrics = tmp_path / "m.jsonl"
  metrics.write_text("\n".join(json.dumps({"step": s, "loss": 5.0 - s, "lr": 1e-3}) for s in range(3)) + "\n")
  assert plot.read_run(str(metrics))["loss"] == {0: 5.0, 1: 4.0, 2: 3.0}
  out = plot.write([os.path.join(config.base_output_directory, "story"), str(metrics)], str(tmp_path / "both.png"))
  assert open(out, "rb").read(4) == b"\x89PNG"
  from maxtext.errors import DataError

  with pytest.raises(DataError, match="neither a run directory nor a metrics file"):
    plot.read_run(str(tmp_path / "missing"))


def test_eval_only_matches_the_loops_eval_of_the_same_checkpoint(finished_run):
  config, result, _ = finished_run
  r = evaluate(config, log=lambda _: None, mesh=mesh_for(config))  # the run's own latest checkpoint (step 4)
  assert r["eval_loss"] == pytest.approx(result.eval_losses[3], rel=1e-5)
  assert r["perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
