"""Bad chat templates and unusable DPO pairs, each run as the user would: exit 2, one `error:` line naming the template
(or the pairs' cause), no traceback, nothing written. The renderer's limits themselves are tests/test_sft_templates.py."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import pytest

from tests.test_bad_inputs import GRAIN_JSONL, _run_case, _train, assert_one_line_exit_2
from tests.test_data_common import sp_model

SFT = (*GRAIN_JSONL, "grain_train_files={tmp}/chat.jsonl", "use_sft=true", "train_data_columns=[messages]", "max_target_length=64")
IN_PROCESS = "grain_worker_count=0"  # cheaper; the divide-by-zero case renders in a grain worker process, as by default
TEMPLATES = {
  "loops.jinja": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
  "huge.jinja": "{{ 'x' * 300000000 }}",
  "divide.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}{{ 1/0 }}",
  "recursive.jinja": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}

# (id, argv, what the one line must mention)
CASES = [
  ("chat_template_nested_loops", _train(*SFT, IN_PROCESS, "chat_template_path={tmp}/loops.jinja"), "loops.jinja') did not finish rendering within 10 s"),
  ("chat_template_300_mb_string", _train(*SFT, IN_PROCESS, "chat_template_path={tmp}/huge.jinja"), "huge.jinja') failed: rendered more than"),
  ("chat_template_divides_by_zero", _train(*SFT, "chat_template_path={tmp}/divide.jinja"), "divide.jinja') failed: ZeroDivisionError"),
  ("chat_template_recursive_macro", _train(*SFT, IN_PROCESS, "chat_template_path={tmp}/recursive.jinja"), "recursive.jinja') failed: RecursionError"),
  (
    "dpo_pairs_all_equal",
    _train(*GRAIN_JSONL, "grain_train_files={tmp}/pairs.jsonl", "use_dpo=true", "train_data_columns=[prompt,chosen,rejected]", IN_PROCESS),
    "has no usable DPO pair: of the 8 pairs, 8 have chosen equal to rejected",
  ),
]


def _make_inputs(tmp: Path) -> None:
  turns = [{"role": "user", "content": "the model reads"}, {"role": "assistant", "content": "text and learns"}]
  (tmp / "chat.jsonl").write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(8)))
  (tmp / "pairs.jsonl").write_text("".join(json.dumps({"prompt": "the model", "chosen": f"reads {i}", "rejected": f"reads {i}"}) + "\n" for i in range(8)))
  for name, text in TEMPLATES.items():
    (tmp / name).write_text(text)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """Run every case (two at a time) once; each gets its own scratch directory."""
  sp = sp_model()
  run = tmp_path_factory.mktemp("no_run")
  jobs = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    for case_id, argv, _ in CASES:
      tmp = tmp_path_factory.mktemp("case") / "work"
      tmp.mkdir()
      _make_inputs(tmp)
      jobs[case_id] = pool.submit(_run_case, argv, tmp, run, sp)
  return {k: v.result() for k, v in jobs.items()}


@pytest.mark.parametrize("case_id,argv,mention", CASES, ids=[c[0] for c in CASES])
def test_bad_template_or_pairs_is_one_line_exit_2_nothing_written(results, case_id, argv, mention):
  proc, before, after = results[case_id]
  assert_one_line_exit_2(proc, mention)
  assert after == before  # no directory, lock, checkpoint, events file or metrics file appeared or changed
