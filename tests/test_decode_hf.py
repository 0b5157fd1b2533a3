"""Greedy decoding is token-exact with transformers' generate for every family (float32, tiny random models).

One batch holds prompts of different lengths, so this also checks per-row positions against each prompt alone.
DeepSeek (MLA) decodes from its compressed latent cache in the absorbed form, with YaRN and without it (the naive
per-head cache is checked against the full forward pass in tests/test_decode_mla.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maxtext import from_hf
from maxtext.inference import Generator
from tests.hf_fixtures import FAMILY_CONFIGS, save_tiny_model

FAMILIES = [name for name in FAMILY_CONFIGS if name != "deepseek_q0"]  # deepseek and deepseek_plain cover MLA decoding
PROMPT_LENGTHS = (3, 9)
MAX_TARGET_LENGTH = 17  # 8 to 14 new tokens per row: past gemma2/mistral's window of 4, so the ring buffers wrap


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers_generate(tmp_path, name):
  torch_model = save_tiny_model(name, tmp_path)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 97, size=n).tolist() for n in PROMPT_LENGTHS]
  eos = torch_model.config.eos_token_id
  model, config = from_hf(tmp_path, scan_layers=name != "mistral", dtype="float32", matmul_precision="highest")
  gen = Generator(model, config=config, max_target_length=MAX_TARGET_LENGTH, max_prefill_length=16, eos_id=eos)
  ours = gen.generate(prompts).tokens
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      ref = torch_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TARGET_LENGTH - len(prompt), do_sample=False, eos_token_id=eos, pad_token_id=0)[
        0, len(prompt) :
      ].tolist()
    assert got == ref, f"{name}: prompt of {len(prompt)} tokens"
