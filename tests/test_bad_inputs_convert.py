"""Hugging Face directories conversion must refuse, run as the user would (one subprocess per case: exit 2, one
`error:` line naming the config.json field or the tensor, no traceback, nothing written), and the same checks in
process where the point is the rule rather than the command.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from maxtext.convert import hf_config, hf_params, mxfp4, safetensors_io
from maxtext.convert.hf_fields import HFFields
from maxtext.errors import ConfigError
from tests.test_bad_inputs import CONVERT, REPO, _hf_dir, _run_case

DECODE = [sys.executable, "-m", "maxtext.decode", str(REPO / "configs" / "base.yml"), "hf_model_path={tmp}/hf", "prompt=a", "max_target_length=8"]


def _config(**edit) -> Callable[[Path], None]:
  """Set (or, with None, remove) config.json fields of the tiny Llama directory."""

  def apply(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))

  return apply


def _tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
  def apply(d: Path) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))

  return apply


def _second_layer(t: dict) -> None:
  """A copy of layer 0 as layer 1: the safetensors hold 2 layers, config.json says 1."""
  t.update({k.replace("layers.0.", "layers.1."): v for k, v in list(t.items()) if k.startswith("model.layers.0.")})


# (id, argv, how the tiny Llama directory {tmp}/hf is broken, what the error line names)
CASES = [
  (
    "fewer_layers_than_the_safetensors",
    [*CONVERT, "--hf-dir", "{tmp}/hf"],
    _tensors(_second_layer),
    "num_hidden_layers is 1: the layers past it would be dropped",
  ),
  (
    "unknown_tensor_past_the_layers",
    [*CONVERT, "--hf-dir", "{tmp}/hf"],
    _tensors(lambda t: t.update({"model.layers.7.mlp.extra.weight": np.ones(4, np.float32)})),
    "'model.layers.7.mlp.extra.weight'",
  ),
  (
    "int32_weight",
    [*CONVERT, "--hf-dir", "{tmp}/hf"],
    _tensors(lambda t: t.update({"model.norm.weight": np.ones(16, np.int32)})),
    "tensor 'model.norm.weight' has dtype int32, not a floating type",
  ),
  (
    "nan_weight",
    [*CONVERT, "--hf-dir", "{tmp}/hf"],
    _tensors(lambda t: t["model.layers.0.mlp.down_proj.weight"].__setitem__((3, 5), np.nan)),
    "tensor 'model.layers.0.mlp.down_proj.weight' holds 1 NaN or infinite value(s)",
  ),
  (
    "num_hidden_layers_true",
    [*CONVERT, "--hf-dir", "{tmp}/hf"],
    _config(num_hidden_layers=True),
    "config.json's num_hidden_layers is true, not a whole number",
  ),
  ("num_hidden_layers_zero", [*CONVERT, "--hf-dir", "{tmp}/hf"], _config(num_hidden_layers=0), "config.json's num_hidden_layers is 0, not a whole number >= 1"),
  ("hidden_size_missing", [*CONVERT, "--hf-dir", "{tmp}/hf"], _config(hidden_size=None), "config.json's hidden_size is missing"),
  ("rope_theta_a_word", [*CONVERT, "--hf-dir", "{tmp}/hf"], _config(rope_theta="ten"), 'config.json\'s rope_theta is "ten", not a number > 0'),
  ("decode_num_hidden_layers_a_string", DECODE, _config(num_hidden_layers="2"), 'config.json\'s num_hidden_layers is "2", not a whole number'),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """Run every case (three at a time) once; each gets its own scratch directory with the broken {tmp}/hf."""
  untouched = tmp_path_factory.mktemp("untouched")  # _run_case's run directory: no case names one
  jobs = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    for case_id, argv, breaks, _ in CASES:
      tmp = tmp_path_factory.mktemp("case") / "work"
      tmp.mkdir()
      _hf_dir(tmp / "hf", 16, 16)
      breaks(tmp / "hf")
      jobs[case_id] = pool.submit(_run_case, argv, tmp, untouched, "")
  return {k: v.result() for k, v in jobs.items()}


@pytest.mark.parametrize("case_id,argv,breaks,mention", CASES, ids=[c[0] for c in CASES])
def test_bad_hf_directory_is_one_line_exit_2_nothing_written(results, case_id, argv, breaks, mention):
  proc, before, after = results[case_id]
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  assert mention in lines[0]
  assert "Traceback" not in proc.stdout + proc.stderr and "command line" not in lines[0]
  assert after == before  # --out was not made, the HF directory is unchanged


LLAMA = dict(model_type="llama", hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=64)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size"])
def test_a_required_field_missing_or_null_is_named(field):
  for value in ({k: v for k, v in LLAMA.items() if k != field}, {**LLAMA, field: None}):
    with pytest.raises(ConfigError, match=f"config.json's {field} is (missing|null); maxtext needs it"):
      hf_config.overrides_from_hf(value)


@pytest.mark.parametrize(
  "edit,message",
  [
    ({"vocab_size": 64.5}, "vocab_size is 64.5, not a whole number"),
    ({"head_dim": False}, "head_dim is false, not a whole number"),
    ({"rms_norm_eps": "1e-5"}, 'rms_norm_eps is "1e-5", not a number > 0'),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings is 1, not true or false"),
    ({"hidden_act": 3}, "hidden_act is 3, not a string"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "8"}}, 'rope_scaling.factor is "8", not a number > 0'),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters.low_freq_factor is missing"),
    ({"rope_scaling": [1, 2]}, "rope_scaling is [1, 2], not an object of settings"),
    ({"rope_theta": float("inf")}, "rope_theta is Infinity, not a number > 0"),
  ],
)
def test_config_json_fields_are_read_by_type(edit, message):
  with pytest.raises(ConfigError, match=f"^config.json's {message.replace('[', '.').replace(']', '.')}"):
    hf_config.overrides_from_hf({**LLAMA, **edit})


def test_whole_floats_and_nulls_read_as_hf_means_them():
  out = hf_config.overrides_from_hf({**LLAMA, "vocab_size": 64.0, "head_dim": None, "num_key_value_heads": None, "rope_scaling": None})
  assert (out["vocab_size"], out["head_dim"], out["base_num_kv_heads"], out["rope_max_timescale"]) == (64, 8, 2, 10_000.0)
  assert type(out["vocab_size"]) is int
  assert HFFields({"n": 3}, "x/config.json", "text_config.").name("n") == "x/config.json's text_config.n"


def test_only_declared_mtp_layers_may_be_left_out():
  assert hf_config.stored_mtp_layers({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}) == 1
  assert hf_config.stored_mtp_layers({"model_type": "llama", "num_nextn_predict_layers": 1}) == 0  # no other family stores MTP layers
  with pytest.raises(ConfigError, match="num_nextn_predict_layers is true"):
    hf_config.stored_mtp_layers({"model_type": "deepseek_v3", "num_nextn_predict_layers": True})


def test_quantized_checkpoints_and_bad_mxfp4_tensors_are_named(tmp_path):
  from maxtext.hf import config_from_hf

  _hf_dir(tmp_path / "hf", 16, 16)
  tensors = safetensors_io.read_tensors(tmp_path / "hf")
  config = config_from_hf(tmp_path / "hf")
  assert sorted(hf_params.hf_to_maxtext(tensors, config))  # the directory converts as it is
  with pytest.raises(ConfigError, match="the checkpoint is quantized \\('model.layers.0.mlp.down_proj.weight_scale_inv' is a scale tensor\\)"):
    hf_params.hf_to_maxtext({**tensors, "model.layers.0.mlp.down_proj.weight_scale_inv": np.ones(2, np.float32)}, config)
  with pytest.raises(ConfigError, match="'x.down_proj_blocks' \\(int32 \\(1, 2, 3, 16\\)\\) .* not uint8 blocks"):
    mxfp4.dense_experts({"x.down_proj_blocks": np.zeros((1, 2, 3, 16), np.int32), "x.down_proj_scales": np.zeros((1, 2, 3), np.uint8)})


def test_a_tensor_in_two_shards_and_a_broken_index_are_refused(tmp_path):
  save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "one.safetensors"))
  save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "two.safetensors"))
  with pytest.raises(ConfigError, match="tensor 'a' is stored in both .*one.safetensors' and .*two.safetensors'"):
    safetensors_io.read_tensors(tmp_path)
  (tmp_path / safetensors_io.INDEX).write_text(json.dumps({"metadata": {}}))
  with pytest.raises(ConfigError, match="has no weight_map"):
    safetensors_io.read_tensors(tmp_path)


def test_deepseek_dense_layers_must_leave_a_moe_layer():
  deepseek = dict(model_type="deepseek_v3", num_attention_heads=2, n_routed_experts=4, num_hidden_layers=2, first_k_dense_replace=2)
  with pytest.raises(ConfigError, match="first_k_dense_replace=2 for num_hidden_layers=2, which leaves no MoE layer"):
    hf_config.overrides_from_hf(deepseek)
