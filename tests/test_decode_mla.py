"""DeepSeek (MLA) decoding: the compressed latent cache holds kv_lora_rank + qk_rope_head_dim values per token and layer
(its bytes equal the formula, beside the naive per-head size), and cached logits equal the full forward pass, for the
compressed (absorbed) and the naive form, scanned and unscanned, through the dense first layers and the MoE layers."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from maxtext.config import from_overrides
from maxtext.inference import cache_layout
from maxtext.inference.generate import Generator
from tests.test_decode import assert_cached_logits_equal_full_forward, full_logits, perturbed

TINY_MLA = dict(
  decoder_block="deepseek",
  base_emb_dim=32,
  base_num_query_heads=4,
  base_num_kv_heads=4,
  base_mlp_dim=48,
  base_moe_mlp_dim=16,
  base_num_decoder_layers=3,
  head_dim=12,
  vocab_size=97,
  q_lora_rank=12,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=4,
  v_head_dim=6,
  num_experts=4,
  num_experts_per_tok=2,
  shared_experts=1,
  first_num_dense_layers=1,
  routed_score_func="sigmoid",
  routed_bias=True,
  norm_topk_prob=True,
  rope_type="yarn",
  rope_factor=4,
  original_max_position_embeddings=4,
  mscale=1.0,
  dtype="float32",
  matmul_precision="highest",
  max_target_length=24,
  max_prefill_predict_length=16,
  num_devices=1,
)


@functools.cache
def built(naive: bool, scan: bool):
  config = from_overrides(**TINY_MLA, mla_naive_kvcache=naive, scan_layers=scan)
  model = perturbed(config)
  gen = Generator(model, config=config, max_target_length=config.max_target_length, max_prefill_length=config.max_prefill_predict_length)
  tokens = np.random.default_rng(0).integers(0, 97, size=(2, 20)).astype(np.int32)
  return config, gen, tokens, full_logits(model, tokens)


def test_cache_bytes_equal_the_formula():
  config = from_overrides(**TINY_MLA)
  lay = cache_layout.layout(config)
  cache = cache_layout.zeros(config, 2, lay)
  layers, slots = config.num_decoder_layers, config.max_target_length
  latent = 2 * layers * slots * (config.kv_lora_rank + config.qk_rope_head_dim) * 4  # batch x layers x slots x 20 values x float32
  naive = 2 * layers * slots * config.num_query_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * 4
  assert cache_layout.nbytes(cache) == (latent, 2 * 4)
  assert cache_layout.theoretical_bytes(config, 2, lay) == latent
  assert cache_layout.theoretical_bytes(config, 2, lay, "mla_naive") == naive
  line = cache_layout.describe(config, 2, lay)
  assert f"{latent / 2**20:,.2f} MiB" in line and f"{naive / 2**20:,.2f} MiB ({naive / latent:.1f}x)" in line and "20 values per token" in line
  naive_config = from_overrides(**TINY_MLA, mla_naive_kvcache=True)
  assert cache_layout.nbytes(cache_layout.zeros(naive_config, 2, cache_layout.layout(naive_config)))[0] == naive


@pytest.mark.parametrize("naive, scan", [(False, True), (True, False)], ids=["latent-scanned", "naive-unscanned"])
def test_cached_logits_equal_full_forward(naive, scan):
  config, gen, tokens, full = built(naive, scan)
  assert_cached_logits_equal_full_forward(config, gen, tokens, full, steps=6)
