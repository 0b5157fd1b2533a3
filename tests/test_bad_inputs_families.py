"""Hugging Face configs of the qwen2 and olmo3 families that maxtext must refuse: a layer pattern that contradicts the
layer count (one subprocess, as the user runs the converter: exit 2, one `error:` line, nothing written), and in
process the rules behind it (a pattern other than the family's, a feature the family does not build)."""

from __future__ import annotations

import json

import pytest

from maxtext.convert import hf_config
from maxtext.errors import ConfigError
from tests.hf_fixtures import FAMILY_CONFIGS, save_tiny_model
from tests.test_bad_inputs import CONVERT, _run_case, assert_one_line_exit_2


def _overrides(name: str, **edit) -> dict:
  return hf_config.overrides_from_hf({**FAMILY_CONFIGS[name]().to_dict(), **edit})


def test_olmo3_layer_types_shorter_than_the_layers_is_one_line_exit_2(tmp_path):
  hf = tmp_path / "hf"
  save_tiny_model("olmo3", hf)
  cfg = json.loads((hf / "config.json").read_text())
  (hf / "config.json").write_text(json.dumps({**cfg, "layer_types": cfg["layer_types"][:4]}))  # 4 types, 5 layers
  run = tmp_path / "run"
  run.mkdir()
  proc, before, after = _run_case([*CONVERT, "--hf-dir", "{tmp}/hf"], hf.parent, run, "")
  assert_one_line_exit_2(proc, "config.json lists 4 layer_types for num_hidden_layers=5")
  assert before == after and not (tmp_path / "converted").exists()


def test_olmo3_layer_types_must_be_three_sliding_per_full():
  types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"]
  with pytest.raises(ConfigError, match="layer_types say layer 1 is full_attention, but olmo3 alternates as"):
    _overrides("olmo3", layer_types=types)


def test_qwen2_sliding_layers_are_refused_by_name():
  with pytest.raises(ConfigError, match="qwen2 config.json sets use_sliding_window=true .* set use_sliding_window=false"):
    _overrides("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
  with pytest.raises(ConfigError, match="layer_types say layer 2 is sliding_attention"):
    _overrides("qwen2", layer_types=["full_attention", "full_attention", "sliding_attention"])
  assert _overrides("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=3)["sliding_window_size"] == 0  # no layer slides


def test_yarn_attention_factor_is_read_only_as_its_derived_value():
  """Olmo 3's config.json states YaRN's attention_factor (0.1 ln(factor) + 1); another value would change the scores."""
  yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 8192}
  sliding = {"rope_type": "default", "rope_theta": 500000.0}
  derived = _overrides("olmo3", rope_parameters={"full_attention": {**yarn, "attention_factor": 1.2079441541679836}, "sliding_attention": sliding})
  assert (derived["rope_factor"], derived["rope_attention_scaling"], derived["rope_interleave"]) == (8, True, False)
  with pytest.raises(ConfigError, match="yarn attention_factor 1.5 in config.json is not supported"):
    _overrides("olmo3", rope_parameters={"full_attention": {**yarn, "attention_factor": 1.5}, "sliding_attention": sliding})


def test_olmo3_legacy_rope_scaling_scales_only_the_full_layers_as_transformers_reads_it():
  """The published config.json gives rope_scaling and rope_theta (no per-layer-type rope_parameters): transformers 5
  puts the YaRN on the full layers and plain rope of rope_theta on the sliding ones; so does maxtext."""
  import transformers

  yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 32, "beta_slow": 1}
  legacy = {**FAMILY_CONFIGS["olmo3"]().to_dict(), "rope_parameters": None, "rope_scaling": {**yarn, "attention_factor": 1.2079441541679836}}
  legacy["rope_theta"] = 500000.0
  theirs = transformers.Olmo3Config(**{k: v for k, v in legacy.items() if k not in ("model_type", "rope_parameters")}).rope_parameters
  assert theirs["sliding_attention"] == {"rope_type": "default", "rope_theta": 500000.0} and theirs["full_attention"]["rope_type"] == "yarn"
  ours = hf_config.overrides_from_hf(legacy)
  assert (ours["rope_type"], ours["rope_max_timescale"], ours["local_rope_max_timescale"]) == ("yarn", 500000.0, 500000.0)
