"""DeepSeek V4 as a whole model (decoder_block=deepseek4) against transformers' DeepseekV4ForCausalLM (float32, eager).

One tiny random model (tests/test_deepseek_v4.py's at 5 layers: hash-MoE sliding and CSA (rate 2) layers, then HCA
(rate 4) and CSA alternating; hc_mult 4, weights away from init), saved once as transformers writes it (DeepSeek's tensor names):
logits scanned and unscanned on a sequence both rates divide and one neither divides, the conversion both ways bit
for bit (and transformers loads the export), greedy decoding token for token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from maxtext import from_hf
from maxtext.convert import hf_config_export, hf_params, safetensors_io
from maxtext.convert.model_params import flat_params
from tests.hf_fixtures import away_from_init, hf_logits
from tests.test_deepseek_v4 import _jit_call, tiny_config

ROOT = Path(__file__).resolve().parents[1]
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Two hash-routed layers of two structures (a prefix run layer by layer, scanned or not), then CSA and HCA alternating
# (scanned: a group of the pair, then the last HCA layer as the remainder).
LAYER_TYPES = [SLIDING, CSA, HCA, CSA, HCA]
MLP_LAYER_TYPES = ["hash_moe"] * 2 + ["moe"] * 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(directory, torch model) of the tiny model with a random tid2eid table."""
  torch.manual_seed(0)
  model = transformers.DeepseekV4ForCausalLM(tiny_config(num_hidden_layers=5, layer_types=LAYER_TYPES, mlp_layer_types=MLP_LAYER_TYPES)).eval()
  away_from_init(model)
  with torch.no_grad():
    for layer in model.model.layers:
      if layer.mlp.is_hash:
        layer.mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(4)[:2] for _ in range(97)]))
  d = tmp_path_factory.mktemp("deepseek_v4")
  model.save_pretrained(d)
  return d, model


@pytest.mark.parametrize("scan, seq", [(True, 12), (False, 11)])
def test_logits_match_transformers(saved, scan, seq):
  """seq 12: both compress rates (2, 4) divide it; 11: neither (a partial window gives no entry yet)."""
  hf_dir, torch_model = saved
  model, config = from_hf(hf_dir, scan_layers=scan, dtype="float32", matmul_precision="highest")
  assert (config.decoder_block, config.compress_ratios, config.csa_compress_ratio, config.first_num_hash_layers) == ("deepseek4", [0, 2, 4, 2, 4], 2, 2)
  assert config.mhc_expansion_rate == 4
  tokens = np.random.default_rng(seq).integers(0, 97, size=(2, seq)).astype(np.int32)
  np.testing.assert_allclose(np.asarray(_jit_call(model, tokens)), hf_logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_round_trip_is_bit_identical_and_exports_to_transformers(saved, tmp_path):
  hf_dir, torch_model = saved
  model, config = from_hf(hf_dir, dtype="float32")
  back = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(hf_dir)
  assert sorted(back) == sorted(original) and "model.layers.0.ffn.gate.tid2eid" in back
  for k, v in original.items():
    assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k
  exported = hf_config_export.hf_config_from(config)
  assert exported["layer_types"] == torch_model.config.layer_types and exported["mlp_layer_types"] == torch_model.config.mlp_layer_types
  safetensors_io.write(tmp_path, exported, back)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
  tokens = np.random.default_rng(3).integers(0, 97, size=(1, 9))
  np.testing.assert_allclose(hf_logits(loaded, tokens), hf_logits(torch_model, tokens), atol=1e-5, rtol=0)


def test_greedy_decode_over_the_compressed_cache_matches_transformers_generate(saved):
  """Prompts of 3 and 9 tokens, 17 tokens in all: prefill and decode steps pool each window's entry from the cached
  projections once its last token arrives (CSA every 2 tokens, over its previous window too; HCA every 4), the sliding
  window a ring of 4; scanned (the main stack a group of HCA and CSA plus a remainder layer)."""
  from maxtext.inference import Generator

  hf_dir, torch_model = saved
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 97, size=n).tolist() for n in (3, 9)]
  eos = torch_model.config.eos_token_id
  model, config = from_hf(hf_dir, dtype="float32", matmul_precision="highest")
  generator = Generator(model, config=config, max_target_length=17, max_prefill_length=16, eos_id=eos)
  assert set(generator.layout.forms) == {"compressed:0", "compressed:2+index", "compressed:4"}
  for prompt, got in zip(prompts, generator.generate(prompts).tokens):
    with torch.no_grad():
      ref = torch_model.generate(torch.tensor([prompt]), max_new_tokens=17 - len(prompt), do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert got == ref[0, len(prompt) :].tolist(), f"prompt of {len(prompt)}"


def test_kv_cache_line_of_deepseek4_284b_against_a_dense_cache():
  """V4 Flash at 65536 tokens: a 128-token window per layer plus an entry every 4 or 128 tokens (and the CSA indexer's
  keys) against every token's 512 values in every layer."""
  from maxtext.config import load
  from maxtext.inference import cache_layout

  config = load([str(ROOT / "configs" / "base.yml"), "model_name=deepseek4-284b", "max_target_length=65536", "dtype=bfloat16"], env={}, num_devices=1)
  line = cache_layout.describe(config, 1, cache_layout.layout(config))
  dense = 65536 * 43 * 512 * 2
  size = cache_layout.theoretical_bytes(config, 1, cache_layout.layout(config))
  assert 4 < dense / size < 8, line  # the CSA layers' entries (one per 4 tokens) and their indexer keys dominate
  assert f"would take {dense / 2**20:,.2f} MiB ({dense / size:.1f}x)" in line, line


def test_routing_bias_update_moves_each_routed_layers_own_bias(saved):
  """routed_bias_update_rate: load row n (layer n; the hash-routed layers have no bias) reaches layer n's score
  correction wherever it sits (the scanned block's positions and the remainder)."""
  from flax import nnx

  from maxtext.layers.moe import update_routing_biases
  from maxtext.models import layer_pattern, registry
  from maxtext.train.step import _expert_slots

  hf_dir, _ = saved
  model, config = from_hf(hf_dir, dtype="float32")
  _, _, other = nnx.split(model, nnx.Param, ...)
  load = 10.0 * np.eye(4, dtype=np.float32)[np.arange(5) % 4]  # layer n loads expert n % 4 alone
  updated = {"/".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(update_routing_biases(other, load, 0.5, True, _expert_slots(config)))}
  before = {"/".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(other)}
  kinds = registry.get(config.decoder_block).kinds(config)
  moved = 0
  for n, (prefix, index) in enumerate(layer_pattern.parameter_slots(kinds, True)):
    path = f"{prefix}/mlp/routed_bias"
    if n < 2:
      assert path not in before  # hash-routed: no score correction
      continue
    delta = np.asarray(updated[path] - before[path])
    delta = delta if index is None else delta[index]
    np.testing.assert_allclose(delta, np.where(np.arange(4) == n % 4, -0.5, 0.5))
    moved += 1
  assert moved == 3
