"""DeepSeek V4 directories conversion must refuse, run as the user would (one subprocess per case: exit 2, one `error:`
line naming the cause, no traceback, nothing written): unknown layer or router types in config.json, and an hc_mult
that contradicts the checkpoint's mHC tensors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from tests.test_bad_inputs import CONVERT, assert_one_line_exit_2, run_cases
from tests.test_deepseek_v4 import tiny_config


def _config(**edit) -> Callable[[Path], None]:
  """Set config.json fields of the tiny DeepSeek V4 directory."""

  def apply(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **edit}))

  return apply


LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"]

# (id, how the tiny V4 directory {tmp}/hf is broken, what the error line names)
CASES = [
  ("unknown_layer_type", _config(layer_types=[*LAYERS[:3], "full_attention"]), "layer_types has unknown layer type(s) full_attention"),
  ("unknown_router_type", _config(scoring_func="sqrt"), "scoring_func is 'sqrt', an unknown router type"),
  ("unknown_mlp_layer_type", _config(mlp_layer_types=["hash_moe", "dense", "moe", "moe"]), "mlp_layer_types has unknown router type(s) dense"),
  ("hc_mult_contradicts_the_checkpoint", _config(hc_mult=2), "does not fit hc_mult=2"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """Save the tiny V4 model once; run every case (two at a time) on a broken copy in its own scratch directory."""
  torch.manual_seed(0)
  saved = tmp_path_factory.mktemp("deepseek_v4") / "hf"
  transformers.DeepseekV4ForCausalLM(tiny_config()).save_pretrained(saved)

  def broken(breaks):
    def make(tmp):
      shutil.copytree(saved, tmp / "hf")
      breaks(tmp / "hf")

    return make

  cases = [(case_id, [*CONVERT, "--hf-dir", "{tmp}/hf"], broken(breaks)) for case_id, breaks, _ in CASES]
  return run_cases(tmp_path_factory, cases, tmp_path_factory.mktemp("untouched"), "")


@pytest.mark.parametrize("case_id,breaks,mention", CASES, ids=[c[0] for c in CASES])
def test_bad_deepseek_v4_directory_is_one_line_exit_2_nothing_written(results, case_id, breaks, mention):
  proc, before, after = results[case_id]
  assert_one_line_exit_2(proc, mention)
  assert after == before  # --out was not made, the directory is unchanged
