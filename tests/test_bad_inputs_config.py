"""Bad config values, command-line bytes and eval sizes, each run as the user would (a subprocess): one `error:` line,
exit 2, no traceback, nothing written (tests/test_bad_inputs.py's machinery; issue 43's config cases)."""

from __future__ import annotations

import concurrent.futures
import sys

import pytest

from tests.test_bad_inputs import REPO, TINY, _run_case, _train, assert_one_line_exit_2


def _eval(*extra: str) -> list[str]:
  """`python -m maxtext.eval` on the tiny model, with key=value overrides replacing its defaults."""
  keys = {**TINY, **dict(e.split("=", 1) for e in extra)}
  return [sys.executable, "-m", "maxtext.eval", str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


# An undecodable byte reaches Python as a lone surrogate (surrogateescape); subprocess turns it back into the byte 0xff.
NOT_UTF8 = "a\udcffb"

# (id, argv, what the one line must mention)
CASES = [
  ("prompt_not_utf8", _train(f"prompt={NOT_UTF8}"), "the value of 'prompt' on the command line is not valid UTF-8 (byte 0xff"),
  ("run_name_not_utf8", _train(f"run_name={NOT_UTF8}"), "the value of 'run_name' on the command line is not valid UTF-8"),
  ("learning_rate_inf", _train("learning_rate=inf"), "invalid value for 'learning_rate' (command line): 'inf'; input should be a finite number"),
  ("adam_weight_decay_nan", _train("adam_weight_decay=.nan"), "invalid value for 'adam_weight_decay' (command line): nan; input should be a finite number"),
  ("adam_eps_zero", _train("adam_eps=0"), "invalid value for 'adam_eps' (command line): 0; input should be greater than 0"),
  (
    "fp8_calibration_negative_factor",
    _train("quantization=fp8_full", "act_quantization_calibration_method=absmax,-3"),
    "'absmax,-3' has a factor that is not > 0",
  ),
  ("fp8_calibration_empty_range", _train("quantization=fp8_full", "weight_quantization_calibration_method=fixed,5,1"), "'fixed,5,1' is not a range [-c, c]"),
  ("adamw_mask_finds_nothing", _train("adamw_mask=[no_such_layer]"), "adamw_mask pattern 'no_such_layer' finds no trained parameter's path"),
  ("eval_steps_zero_on_synthetic_data", _eval("eval_steps=0"), "eval_steps=0 evaluates the whole eval split"),
  (
    "eval_batch_does_not_fit",
    _eval("eval_steps=1", "eval_per_device_batch_size=1e9", "load_parameters_path={tmp}/params"),
    "the compiled eval step needs",
  ),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """Run every case (two at a time: CI has 2 cores) once, each in its own scratch directory."""
  untouched = tmp_path_factory.mktemp("no_run")
  jobs = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    for case_id, argv, _ in CASES:
      tmp = tmp_path_factory.mktemp("case") / "work"
      (tmp / "params").mkdir(parents=True)  # an eval's load_parameters_path: never read, the eval is refused first
      jobs[case_id] = pool.submit(_run_case, argv, tmp, untouched, "")
  return {k: v.result() for k, v in jobs.items()}


@pytest.mark.parametrize("case_id,argv,mention", CASES, ids=[c[0] for c in CASES])
def test_bad_config_is_one_line_exit_2_nothing_written(results, case_id, argv, mention):
  proc, before, after = results[case_id]
  assert_one_line_exit_2(proc, mention)
  assert after == before  # no run directory, lock, checkpoint or events file appeared
