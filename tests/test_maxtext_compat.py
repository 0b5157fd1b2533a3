"""MaxText YAML loads here: MaxText 0.2.5's base.yml and model files (tests/data/maxtext_0.2.5, copied unchanged
from the wheel), MaxText keys without effect at their defaults, and the generated key list."""

from __future__ import annotations

import glob
import importlib.util
import json
from pathlib import Path

import pytest

from maxtext.config import ConfigError, load, load_with_sources, maxtext_keys
from maxtext.config.keys import all_keys
from maxtext.config.render import resolved

ROOT = Path(__file__).resolve().parents[1]
MT = ROOT / "tests" / "data" / "maxtext_0.2.5" / "configs"
MT_BASE = str(MT / "base.yml")
BASE = str(ROOT / "configs" / "base.yml")
MODELS = sorted(p.stem for p in (MT / "models").glob("*.yml"))
DIMS = ("decoder_block", "emb_dim", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim", "num_decoder_layers", "vocab_size", "num_experts")


def test_maxtext_base_yml_loads_and_lists_keys_without_effect():
  config, sources = load_with_sources([MT_BASE], env={}, num_devices=1)
  table = resolved(config, sources)
  inert = {k for k, v in table.items() if maxtext_keys.NOT_IMPLEMENTED in v["source"]}
  assert "use_iota_embed" in inert and "replicate_quant_scale" in inert
  assert inert.isdisjoint(all_keys())  # only keys the schema lacks
  assert table["use_iota_embed"]["value"] is False
  assert config.steps == 150_001 and config.learning_rate == pytest.approx(3e-5)  # MaxText's values of keys implemented here
  assert config.mesh_axes == ["data", "stage", "fsdp", "sequence", "context", "tensor", "expert"]  # MaxText's default axes read as ours


@pytest.mark.parametrize("model", MODELS)
def test_maxtext_model_files_load_unchanged(model):
  config = load([MT_BASE, f"model_name={model}"], env={}, num_devices=1)
  ours = ROOT / "configs" / "models" / f"{model}.yml"
  if ours.is_file():  # the same architecture as this project's own model file
    reference = load([BASE, f"model_name={model}"], env={}, num_devices=1)
    expected = {k: getattr(reference, k) for k in DIMS}
    if config.decoder_block == "gemma2":  # MaxText counts gemma2 layers in (local, global) pairs and pads the vocabulary
      expected.update(num_decoder_layers=reference.num_decoder_layers // 2, vocab_size=256128)
    if config.decoder_block == "gemma":  # MaxText pads Gemma's vocabulary to 256128 too
      expected.update(vocab_size=256128)
    if config.decoder_block in ("qwen3_moe", "qwen3_next") and config.num_experts > 1:  # no dense layers: MaxText sets mlp_dim to the experts' width, unused
      expected.update(mlp_dim=config.mlp_dim)
    if config.decoder_block == "deepseek":  # MLA's widths are qk_nope/qk_rope/v_head_dim; head_dim does nothing (MaxText leaves it at 128)
      expected.update(head_dim=config.head_dim)
    assert {k: getattr(config, k) for k in DIMS} == expected


def test_model_file_axis_rules_update_by_name():
  config = load([MT_BASE, "model_name=llama2-7b"], env={}, num_devices=1)  # the file sets [['norm', 'fsdp']]
  rules = dict((name, list(axes)) for name, axes in config.logical_axis_rules)
  assert rules["norm"] == ["fsdp"] and rules["activation_batch"] == ["data", "fsdp", "expert"]


def test_not_implemented_key_at_default_is_accepted_else_one_line_error():
  config, sources = load_with_sources([BASE, "ici_tensor_transpose_parallelism=1", "use_iota_embed=false"], env={}, num_devices=1)
  assert sources.maxtext_only == {"ici_tensor_transpose_parallelism": 1, "use_iota_embed": False}
  with pytest.raises(
    ConfigError,
    match=r"'ici_tensor_transpose_parallelism' \(on the command line\) is a MaxText option this project does not implement; only its MaxText default 1",
  ):
    load([BASE, "ici_tensor_transpose_parallelism=2"], env={}, num_devices=1)
  with pytest.raises(ConfigError, match="'use_post_attn_norm'"):  # true only where this project does it (gemma2)
    load([BASE, "use_post_attn_norm=true"], env={}, num_devices=1)
  load([BASE, "decoder_block=gemma2", "use_post_attn_norm=true"], env={}, num_devices=1)
  assert load([BASE], env={"M_QUANTIZATION": ""}, num_devices=1).steps > 0  # env at MaxText's default: no effect


def test_unknown_key_still_suggests():
  with pytest.raises(ConfigError, match=r"unknown config key 'stepz' \(did you mean 'steps'\?\)"):
    load([BASE, "stepz=3"], env={}, num_devices=1)


def _generator():
  spec = importlib.util.spec_from_file_location("generate_maxtext_keys", ROOT / "scripts" / "generate_maxtext_keys.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_generated_key_list_matches_its_sources():
  data = json.loads((ROOT / "maxtext" / "config" / "maxtext_keys.json").read_text())
  gen = _generator()
  base = gen._yaml_base(MT / "base.yml")
  for key, value in base.items():  # base.yml's defaults are MaxText's effective defaults
    assert data["keys"][key] == {"default": value}, key
  seeds = sorted(glob.glob(str(ROOT.parent / "shared" / "seeds" / "004_*.txt")))
  if seeds:  # the config reference beside the clone: the committed file is exactly what the script makes
    assert gen.generate(Path(seeds[0]).read_text(), base) == data
