"""Llama 4 (family llama4, text decoder): dense and top-1 MoE layers interleaved (the expert's input weighted by a sigmoid
router score, beside a shared expert), chunked local attention with interleaved rope and an L2 query/key norm on the rope
layers, NoPE global layers with temperature tuning; converted from and compared with transformers' Llama4ForCausalLM
(tiny, random, float32, eager)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import transformers

from maxtext import from_hf
from maxtext.config import from_overrides, load
from maxtext.convert import hf_config, hf_params, safetensors_io
from maxtext.convert.model_params import flat_params
from maxtext.errors import ConfigError
from maxtext.inference import Generator, cache_layout
from maxtext.models import counting, layer_pattern, registry
from tests.hf_fixtures import hf_logits

LAYERS = 6  # dense/MoE pairs; NoPE at layers 3 (and 7, ...): the pattern's period is 4, the structures' 2
CHUNK = 4  # attention_chunk_size: the test sequences span several chunks
VOCAB = 97


def tiny_config(**extra) -> transformers.Llama4TextConfig:
  fields = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=16,
    intermediate_size_mlp=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    no_rope_layer_interval=4,
    attention_chunk_size=CHUNK,
    use_qk_norm=True,
    attention_bias=True,
    attn_temperature_tuning=True,
    floor_scale=4,  # short sequences reach the tuned positions
    attn_scale=0.5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
  )
  return transformers.Llama4TextConfig(**{**fields, **extra})


@functools.cache
def saved(tmp: str) -> transformers.PreTrainedModel:
  """A tiny random Llama4ForCausalLM saved to tmp, every parameter (norms, biases) away from its init."""
  torch.manual_seed(0)
  model = transformers.Llama4ForCausalLM(tiny_config()).float().eval()
  model.config._attn_implementation = "eager"
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
  d = tmp_path_factory.mktemp("llama4")
  return d, saved(str(d))


def test_pattern_interleaves_dense_and_moe_with_nope_every_fourth_layer():
  c = from_overrides(**hf_config.overrides_from_hf(tiny_config().to_dict()), num_devices=1)
  kinds = registry.get("llama4").kinds(c)
  assert [k.ffn for k in kinds] == ["dense", "moe_shared"] * 3
  assert [k.span for k in kinds] == [-CHUNK, -CHUNK, -CHUNK, 0, -CHUNK, -CHUNK]
  (stack,) = layer_pattern.stacks(kinds)
  assert (stack.period, stack.num_groups, len(stack.remainder), layer_pattern.decode_period(stack)) == (2, 3, 0, 4)
