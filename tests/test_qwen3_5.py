"""Qwen3.5 (families qwen3_5 and qwen3_5_moe): Qwen3-Next's hybrid layers with the Gated DeltaNet projections split
into in_proj_qkv, in_proj_z, in_proj_b and in_proj_a; dense or experts beside a gated shared expert. Converted from
and compared with transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM (tiny, random, float32, eager)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import transformers

from maxtext import from_hf
from maxtext.config import from_overrides
from maxtext.convert import hf_config, hf_params, safetensors_io
from maxtext.convert.model_params import flat_params
from maxtext.errors import ConfigError
from maxtext.inference import Generator
from maxtext.models import registry
from tests.hf_fixtures import hf_logits

LAYERS = 5  # one scanned group of 4 (3 linear + 1 full attention) and a linear remainder layer
CHUNK = 8  # gdn_chunk_size: the test sequences span more than two chunks and end mid-chunk
VARIANTS = ("dense", "moe")


def tiny_config(variant: str, **extra) -> transformers.PretrainedConfig:
  shape = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    max_position_embeddings=64,
  )
  if variant == "dense":
    return transformers.Qwen3_5TextConfig(**shape, intermediate_size=48, **extra)
  return transformers.Qwen3_5MoeTextConfig(
    **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, **extra
  )


@functools.cache
def saved(variant: str, tmp: str) -> transformers.PreTrainedModel:
  """A tiny random Qwen3.5 causal LM saved to tmp, every parameter (norms, A_log, dt_bias) away from its init."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(tiny_config(variant), attn_implementation="eager").float().eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.2)
  model.save_pretrained(tmp)
  return model


@pytest.fixture(scope="module", params=VARIANTS)
def hf_dir(request, tmp_path_factory):
  d = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
  return request.param, d, saved(request.param, str(d))


@pytest.mark.parametrize("variant, family, ffn", [("dense", "qwen3_5", "dense"), ("moe", "qwen3_5_moe", "moe_shared")])
def test_pattern_and_family(variant, family, ffn):
  config = hf_config.overrides_from_hf(tiny_config(variant).to_dict())
  assert config["decoder_block"] == family and config["inhomogeneous_layer_cycle_interval"] == 4 and config["partial_rotary_factor"] == 0.25
  c = from_overrides(**config, num_devices=1)
  kinds = registry.get(family).kinds(c)
  assert [k.mixer for k in kinds] == ["gated_deltanet"] * 3 + ["attention", "gated_deltanet"]
  assert {k.ffn for k in kinds} == {ffn}


@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_transformers(hf_dir, scan):
  _, d, torch_model = hf_dir
  tokens = np.random.default_rng(0).integers(0, 97, size=(2, 2 * CHUNK + 5)).astype(np.int32)
  model, _ = from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK)
  np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(torch_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan", [True, False])
def test_greedy_decode_matches_transformers_generate(hf_dir, scan):
  """A mixed-length batch: attention layers decode from KV caches, Gated DeltaNet layers from fixed-size states."""
  _, d, torch_model = hf_dir
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 97, size=n).tolist() for n in (3, 2 * CHUNK + 3)]
  eos = torch_model.config.eos_token_id
  model, _ = from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK)
  ours = Generator(model, max_target_length=32, max_prefill_length=24, eos_id=eos).generate(prompts).tokens
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=32 - len(prompt), do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert got == out[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"


def test_round_trip_and_export_load_in_transformers(hf_dir, tmp_path):
  """HF -> maxtext -> HF is bit-identical, and the exported config.json + safetensors give transformers' logits."""
  variant, d, torch_model = hf_dir
  model, config = from_hf(d, dtype="float32")
  tensors = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(d)
  assert sorted(tensors) == sorted(original)
  for k, v in original.items():
    assert np.array_equal(tensors[k], v), k
  exported_config = hf_config.hf_config_from(config)
  assert exported_config["architectures"] == [type(torch_model).__name__]
  safetensors_io.write(tmp_path, exported_config, tensors)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
  tokens = np.random.default_rng(5).integers(0, 97, size=(2, 2 * CHUNK + 5)).astype(np.int32)
  np.testing.assert_allclose(hf_logits(exported, tokens), hf_logits(torch_model, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
  "extra, message",
  [
    (dict(linear_num_key_heads=3), "linear_num_value_heads=4, not a multiple of linear_num_key_heads=3"),
    (dict(layer_types=["linear_attention"] * 3 + ["full_attention"]), "lists 4 layer_types for num_hidden_layers=5"),
    (dict(layer_types=["linear_attention"] * 4 + ["sliding_attention"]), "unknown type.*qwen3_5 has linear_attention and full_attention"),
  ],
)
def test_bad_configs_are_one_line_errors(extra, message):
  fields = {**tiny_config("dense").to_dict(), **extra}
  with pytest.raises(ConfigError, match=message):
    hf_config.overrides_from_hf(fields)
