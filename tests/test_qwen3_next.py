"""Qwen3-Next (family qwen3_next): Gated DeltaNet layers and gated full attention in a 3 + 1 pattern, experts beside a
gated shared expert, converted from and compared with transformers' Qwen3NextForCausalLM (tiny, random, float32, eager)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import transformers

from maxtext import from_hf
from maxtext.convert import hf_config
from maxtext.errors import ConfigError
from maxtext.inference import Generator, cache_layout
from maxtext.models import counting, layer_pattern, registry
from tests.hf_fixtures import hf_logits

LAYERS = 5  # one scanned group of 4 (3 linear + 1 full attention) and a linear remainder layer
CHUNK = 8  # gdn_chunk_size: the test sequences span more than two chunks and end mid-chunk


def tiny_config(**extra) -> transformers.Qwen3NextConfig:
  return transformers.Qwen3NextConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    max_position_embeddings=64,
    **extra,
  )


@functools.cache
def saved(tmp: str) -> transformers.PreTrainedModel:
  """A tiny random Qwen3NextForCausalLM saved to tmp, every parameter (norms, A_log, dt_bias) away from its init."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="eager").float().eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.2)
  model.save_pretrained(tmp)
  return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("qwen3_next")
  return d, saved(str(d))


def test_pattern_is_three_linear_layers_then_full_attention():
  config = hf_config.overrides_from_hf(tiny_config().to_dict())
  assert config["inhomogeneous_layer_cycle_interval"] == 4 and config["partial_rotary_factor"] == 0.25
  from maxtext.config import from_overrides

  c = from_overrides(**config, num_devices=1)
  kinds = registry.get("qwen3_next").kinds(c)
  assert [k.mixer for k in kinds] == ["gated_deltanet"] * 3 + ["attention", "gated_deltanet"]
  assert {k.ffn for k in kinds} == {"moe_shared"}
  (stack,) = layer_pattern.stacks(kinds)
  assert (stack.period, stack.num_groups, len(stack.remainder)) == (4, 1, 1)


@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_transformers(hf_dir, scan):
  d, torch_model = hf_dir
  tokens = np.random.default_rng(0).integers(0, 97, size=(2, 2 * CHUNK + 5)).astype(np.int32)
  model, config = from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK)
  assert config.decoder_block == "qwen3_next"
  np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(torch_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
  "extra, message",
  [
    (dict(linear_num_key_heads=3), "linear_num_value_heads=4, not a multiple of linear_num_key_heads=3"),
    (dict(layer_types=["linear_attention"] * 3 + ["full_attention"]), "lists 4 layer_types for num_hidden_layers=5"),
    (dict(layer_types=["linear_attention"] * 4 + ["sliding_attention"]), "unknown type"),
    (dict(layer_types=["full_attention"] + ["linear_attention"] * 4), "fix layer_types"),
  ],
)
def test_bad_configs_are_one_line_errors(extra, message):
  fields = {**tiny_config().to_dict(), **extra}
  with pytest.raises(ConfigError, match=message):
    hf_config.overrides_from_hf(fields)


@pytest.mark.parametrize("scan", [True, False])
def test_greedy_decode_matches_transformers_generate(hf_dir, scan):
  """Prompts of different lengths in one batch: attention layers decode from their KV caches, Gated DeltaNet layers
  from their fixed-size states (a chunked prefill past CHUNK tokens, then the recurrent form)."""
  d, torch_model = hf_dir
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 97, size=n).tolist() for n in (3, CHUNK + 3)]
  eos = torch_model.config.eos_token_id
  model, _ = from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK)
  ours = Generator(model, max_target_length=24, max_prefill_length=16, eos_id=eos).generate(prompts).tokens
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=24 - len(prompt), do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert got == out[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"


def test_state_bytes_stay_constant_in_length(hf_dir):
  """The KV-cache size line: the Gated DeltaNet layers' bytes do not grow with max_target_length."""
  d, _ = hf_dir
  _, config = from_hf(d, dtype="float32")
  short, long = (cache_layout.theoretical_bytes(config, 1, cache_layout.layout(config, n)) for n in (32, 64))
  attention_bytes_per_token = 2 * config.num_kv_heads * config.head_dim * 4  # one full-attention layer, float32
  assert long - short == 32 * attention_bytes_per_token


def test_flops_count_gated_deltanet_scores_within_a_chunk(hf_dir):
  """Training FLOPs: a Gated DeltaNet layer scores each token against its chunk, not against the whole sequence."""
  d, _ = hf_dir
  _, config = from_hf(d, dtype="float32", gdn_chunk_size=CHUNK, max_target_length=64)
  assert counting.attended_keys(config) == 4 * CHUNK + 64  # four linear layers, one full-attention layer
