"""Each family matches Hugging Face transformers (PyTorch CPU, float32, eager attention) on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest

from maxtext import from_hf
from maxtext.convert import hf_params, safetensors_io
from maxtext.convert.model_params import flat_params
from tests.hf_fixtures import FAMILY_CONFIGS, hf_logits, save_tiny_model

FAMILIES = list(FAMILY_CONFIGS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  out = {}
  for name in FAMILIES:
    d = tmp_path_factory.mktemp(name.replace(".", "_"))
    out[name] = (d, save_tiny_model(name, d))
  return out


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, 97, size=(2, 12)).astype(np.int32)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(saved, tokens, name, scan):
  hf_dir, torch_model = saved[name]
  model, config = from_hf(hf_dir, scan_layers=scan, dtype="float32", matmul_precision="highest")
  ours = np.asarray(model(tokens))
  ref = hf_logits(torch_model, tokens)
  assert ours.shape == ref.shape == (2, 12, config.vocab_size)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_bit_identical(saved, name):
  hf_dir, _ = saved[name]
  model, config = from_hf(hf_dir, dtype="float32")
  back = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(hf_dir)
  original.pop("lm_head.weight", None) if config.logits_via_embedding else None
  assert sorted(back) == sorted(original)
  for k, v in original.items():
    assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k


@pytest.mark.parametrize("name", ["llama3.1", "qwen3_moe", "gemma", "gemma3", "gpt_oss", "deepseek", "deepseek_plain", "qwen2", "olmo3"])
def test_export_loads_in_transformers_with_the_same_logits(saved, tokens, tmp_path, name):
  """maxtext -> config.json + safetensors (hf_config_from, maxtext_to_hf) -> transformers gives the original logits."""
  import transformers

  from maxtext.convert import hf_config_export

  hf_dir, torch_model = saved[name]
  model, config = from_hf(hf_dir, dtype="float32")
  tensors = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  safetensors_io.write(tmp_path, hf_config_export.hf_config_from(config), tensors)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
  np.testing.assert_allclose(hf_logits(exported, tokens), hf_logits(torch_model, tokens), atol=1e-5, rtol=0)


def test_attention_bias_follows_what_transformers_builds():
  """attention_bias reaches maxtext where the HF class puts q/k/v/o biases (llama: parity above), is ignored as Mistral ignores
  it, is refused for MLA; a mistral model with biases has no HF export."""
  from maxtext.config import ConfigError, from_overrides
  from maxtext.convert import hf_config, hf_config_export

  def overrides(name: str, **extra) -> dict:
    return hf_config.overrides_from_hf({**FAMILY_CONFIGS[name]().to_dict(), **extra})

  assert overrides("llama2", attention_bias=True)["attention_bias"] is True
  assert "attention_bias" not in overrides("mixtral", attention_bias=True)
  with pytest.raises(ConfigError, match="attention biases, which maxtext's deepseek attention does not have"):
    overrides("deepseek", attention_bias=True)
  mistral = from_overrides(num_devices=1, decoder_block="mistral", attention_bias=True)
  with pytest.raises(ConfigError, match="MistralForCausalLM has no attention biases"):
    hf_config_export.hf_config_from(mistral)
