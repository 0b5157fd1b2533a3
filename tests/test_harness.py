"""The lm-evaluation-harness backend (`--model maxtext`) against the harness's own `hf` backend, on a tiny random Llama
directory and local jsonl tasks (nothing downloaded): per-request log-likelihoods within 1e-3, the same accuracy, the
same greedy generations; the rolling log-likelihood; `python -m maxtext.harness` and `maxtext.eval eval_harness_tasks`;
an unknown task is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")

from tests.harness_fixtures import save_model_dir, save_tasks  # noqa: E402
from tests.test_bad_inputs import REPO, _env, _snapshot  # noqa: E402

TASKS = ["tiny_choice", "tiny_gen"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return save_model_dir(tmp_path_factory.mktemp("hf_llama"))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
  return save_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def backends(model_dir):
  """(maxtext backend built from --model_args' string, as the harness builds it; the hf backend) on the same directory."""
  from lm_eval.api.registry import get_model
  from lm_eval.models.huggingface import HFLM

  import maxtext.integrations.lm_eval_backend  # noqa: F401

  ours = get_model("maxtext").create_from_arg_string(f"hf_model_path={model_dir},dtype=float32,max_target_length=64", {"batch_size": 4, "device": "cpu"})
  theirs = HFLM(pretrained=str(model_dir), dtype="float32", batch_size=4, device="cpu", max_length=64)
  return ours, theirs


@pytest.fixture(scope="module")
def evaluated(backends, task_dir):
  from lm_eval.tasks import TaskManager

  tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
  return [lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=tasks, log_samples=True) for lm in backends]


def test_loglikelihoods_and_accuracy_match_the_hf_backend(evaluated):
  ours, theirs = evaluated
  pairs = list(zip(ours["samples"]["tiny_choice"], theirs["samples"]["tiny_choice"], strict=True))
  assert len(pairs) == 4
  for a, b in pairs:
    assert a["doc"] == b["doc"]
    assert len(a["resps"]) == len(b["resps"]) == 4  # one request per choice
    for (la, ga), (lb, gb) in zip([r[0] for r in a["resps"]], [r[0] for r in b["resps"]]):
      assert la == pytest.approx(lb, abs=1e-3)
      assert ga == gb
  assert ours["results"]["tiny_choice"]["acc,none"] == theirs["results"]["tiny_choice"]["acc,none"]


def test_greedy_generations_match_the_hf_backend(evaluated):
  ours, theirs = evaluated
  mine = [s["resps"][0][0] for s in ours["samples"]["tiny_gen"]]
  hf = [s["resps"][0][0] for s in theirs["samples"]["tiny_gen"]]
  assert mine == hf
  assert any(mine), "every generation is empty: nothing compared"
  assert all("w7" not in text for text in mine)  # the task's stop sequence cuts the text


def test_rolling_loglikelihood_matches_the_hf_backend(backends):
  """Texts longer than max_length=16 are scored in the harness's disjoint windows, each the same as the hf backend's."""
  from lm_eval.api.instance import Instance
  from lm_eval.models.huggingface import HFLM

  from maxtext.integrations.lm_eval_backend import MaxTextLM

  ours, theirs = backends
  short_ours = MaxTextLM(ours.model, ours.tokenizer, maxtext_config=ours.maxtext_config, batch_size=4, max_length=16)
  short_theirs = HFLM(pretrained=theirs.model, tokenizer=theirs.tokenizer, batch_size=4, max_length=16)
  texts = [" ".join(f"w{(7 * i + k) % 90}" for i in range(n)) for k, n in ((1, 40), (2, 9))]
  requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
  assert short_ours.loglikelihood_rolling(requests) == pytest.approx(short_theirs.loglikelihood_rolling(requests), abs=1e-3)


def test_harness_command_runs_a_local_task(model_dir, task_dir, capsys):
  from maxtext import harness

  harness.main(
    [
      "--model",
      "maxtext",
      "--model_args",
      f"hf_model_path={model_dir},dtype=float32,max_target_length=64",
      "--tasks",
      "tiny_choice",
      "--include_path",
      str(task_dir),
      "--batch_size",
      "8",
    ]
  )
  out = capsys.readouterr().out
  assert "tiny_choice" in out and "acc" in out


def test_eval_runs_harness_tasks_in_process(model_dir, task_dir, backends, evaluated, capsys):
  """maxtext.eval with eval_harness_tasks prints each task's metrics: the same accuracy as the harness run above."""
  from maxtext import eval as eval_cli

  eval_cli.main(
    [
      str(REPO / "configs" / "base.yml"),
      f"hf_model_path={model_dir}",
      "dtype=float32",
      "max_target_length=64",
      "per_device_batch_size=1",
      "eval_harness_tasks=[tiny_choice]",
      f"eval_harness_include_path={task_dir}",
    ]
  )
  out = capsys.readouterr().out
  acc = evaluated[0]["results"]["tiny_choice"]["acc,none"]
  assert f"tiny_choice: acc: {acc:.4f}" in out


def test_unknown_task_is_one_line_exit_2_nothing_written(model_dir, task_dir, tmp_path):
  argv = [sys.executable, "-m", "maxtext.harness", "--model", "maxtext", "--model_args", f"hf_model_path={model_dir}", "--tasks", "no_such_task"]
  argv += ["--include_path", str(task_dir), "--output_path", str(tmp_path / "results")]
  before = _snapshot(tmp_path)
  proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=dict(_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"), timeout=300)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: unknown harness task(s) no_such_task"), proc.stderr[-3000:]
  assert "Traceback" not in proc.stdout + proc.stderr
  assert _snapshot(tmp_path) == before


def test_unsupported_options_are_one_line_errors_not_ignored(backends):
  from lm_eval.api.instance import Instance

  from maxtext.errors import ConfigError, DataError
  from maxtext.integrations.lm_eval_backend import MaxTextLM

  ours, _ = backends
  with pytest.raises(ConfigError, match="batch_size 'auto'"):
    MaxTextLM(ours.model, ours.tokenizer, maxtext_config=ours.maxtext_config, batch_size="auto")
  with pytest.raises(DataError, match=r"gen_kwargs \['num_beams'\]"):
    ours.generate_until([Instance("generate_until", {}, ("w1 w2", {"until": ["w3"], "num_beams": 2}), 0)])


def test_training_runs_harness_tasks_every_interval_into_the_metrics(model_dir, task_dir, tmp_path, capsys):
  """eval_harness_interval=2 over 4 steps: the tasks run after steps 1 and 3 on the live parameters, in the metrics file."""
  import json

  from maxtext.errors import ConfigError
  from maxtext.train.loop import train
  from tests.test_train_helpers import tiny_config

  keys = dict(tokenizer_type="huggingface", tokenizer_path=str(model_dir), eval_harness_include_path=str(task_dir), eval_harness_interval=2)
  keys.update(base_output_directory=str(tmp_path / "out"), run_name="r", steps=4, enable_checkpointing=False, metrics_file=str(tmp_path / "m.jsonl"))
  with pytest.raises(ConfigError, match="unknown harness task"):
    train(tiny_config(num_devices=8, eval_harness_tasks=["no_such_task"], **keys))
  assert not (tmp_path / "out").exists() and not (tmp_path / "m.jsonl").exists()  # checked before anything is written
  train(tiny_config(num_devices=8, eval_harness_tasks=["tiny_choice"], **keys))
  rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "harness/tiny_choice/acc" in r] == [1, 3]
  assert "harness after step 3: tiny_choice/acc: " in capsys.readouterr().out
