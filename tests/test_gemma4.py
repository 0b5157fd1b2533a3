"""Gemma 4 (family gemma4): sliding and global layers of different shapes (global head width and kv heads, values
from the key projection, proportional rope), per-layer input embeddings, KV-shared last layers with a double-wide MLP,
the MoE block beside the dense MLP (enable_moe_block), converted from and compared with transformers' Gemma4ForCausalLM (tiny, random, float32, eager)."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
import transformers

from maxtext import counting, from_hf
from maxtext.config import from_overrides, load
from maxtext.convert import hf_config, hf_config_export, hf_params, safetensors_io
from maxtext.convert.model_params import flat_params
from maxtext.errors import ConfigError
from maxtext.inference import Generator, cache_layout
from maxtext.models import layer_pattern, registry
from tests.hf_fixtures import away_from_init, hf_logits
from tests.test_bad_inputs import CONVERT, _run_case, assert_one_line_exit_2

VOCAB, WINDOW = 97, 4
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2 + ["full_attention"]  # 2 sliding then 1 global; the last layer global


def tiny_config(**extra) -> transformers.Gemma4TextConfig:
  """7 layers, the last 3 KV-shared (layer 4 reuses layer 3's keys and values, layers 5 and 6 layer 2's)."""
  fields = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=16,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=3,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=4,
    vocab_size_per_layer_input=VOCAB,
    sliding_window=WINDOW,
    layer_types=TYPES,
    final_logit_softcapping=30.0,
    max_position_embeddings=64,
  )
  return transformers.Gemma4TextConfig(**{**fields, **extra})


@functools.cache
def saved(tmp: str) -> transformers.PreTrainedModel:
  """A tiny random Gemma4ForCausalLM saved to tmp, norms and layer scalars away from their init."""
  return _save(tiny_config(), tmp)


def _save(config: transformers.Gemma4TextConfig, tmp: str) -> transformers.PreTrainedModel:
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
  away_from_init(model)
  model.save_pretrained(tmp)
  return model


# The MoE block (4 experts, top 2) beside each layer's dense MLP. Without KV-shared layers: with them, this random
# model's logits move by ~2e-4 between transformers' own float32 and float64 runs, too ill-conditioned for 1e-4.
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16, num_kv_shared_layers=0, use_double_wide_mlp=False)


@functools.cache
def saved_moe(tmp: str) -> transformers.PreTrainedModel:
  """saved() with the MoE block (router scales and per-expert scales away from their init too)."""
  return _save(tiny_config(**MOE), tmp)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("gemma4")
  return d, saved(str(d))


@pytest.fixture(scope="module")
def loaded(hf_dir):
  """The converted model, scanned and unscanned."""
  d, _ = hf_dir
  return {scan: from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest") for scan in (True, False)}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("gemma4_moe")
  return d, saved_moe(str(d))


@pytest.fixture(scope="module")
def moe_loaded(moe_dir):
  """The converted MoE model, scanned and unscanned."""
  d, _ = moe_dir
  return {scan: from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest") for scan in (True, False)}


@pytest.mark.parametrize("scan", [True, False])
def test_moe_logits_match_transformers(moe_dir, moe_loaded, scan):
  """enable_moe_block: the router (its own norm and scale, softmax top-2 renormalised, per-expert scales) and experts
  read the un-normed branch input beside the dense MLP; each output its own post-norm before they add."""
  _, torch_model = moe_dir
  model, config = moe_loaded[scan]
  assert (config.num_experts, config.num_experts_per_tok, config.moe_mlp_dim, config.mlp_dim, config.shared_experts) == (4, 2, 16, 48, 1)
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 3 * WINDOW - 1)).astype(np.int32)
  np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_moe_round_trip_is_bit_exact_and_export_loads_in_transformers(moe_dir, moe_loaded, tmp_path):
  d, torch_model = moe_dir
  model, config = moe_loaded[True]
  tensors = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(d)
  assert sorted(tensors) == sorted(original)
  for k, v in original.items():
    assert np.array_equal(tensors[k], v), k
  exported_config = hf_config_export.hf_config_from(config)
  assert [exported_config[k] for k in ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")] == [True, 4, 2, 16]
  safetensors_io.write(tmp_path, exported_config, tensors)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
  tokens = np.random.default_rng(5).integers(0, VOCAB, size=(2, 11)).astype(np.int32)
  np.testing.assert_array_equal(hf_logits(exported, tokens), hf_logits(torch_model, tokens))


def test_moe_greedy_decode_matches_transformers_generate(moe_dir, moe_loaded):
  _, torch_model = moe_dir
  model, config = moe_loaded[True]
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (3, 2 * WINDOW + 1)]
  eos = torch_model.config.eos_token_id
  ours = Generator(model, config=config, max_target_length=20, max_prefill_length=16, eos_id=eos).generate(prompts).tokens
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=20 - len(prompt), do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert got == out[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"


def test_pattern_sliding_global_and_shared_layers():
  c = from_overrides(**hf_config.overrides_from_hf(tiny_config().to_dict()), num_devices=1)
  kinds = registry.get("gemma4").kinds(c)
  assert [k.window for k in kinds] == [WINDOW, WINDOW, 0, WINDOW, WINDOW, 0, 0]
  assert [k.variant for k in kinds] == ["", "", "global", "", "", "global", "global"]
  assert [k.kv_shared for k in kinds] == [False] * 4 + [True] * 3
  (stack,) = layer_pattern.stacks(kinds)
  assert (stack.period, stack.num_groups) == (7, 1)  # shared layers never repeat the unshared ones: one scanned group
  vision = hf_config.overrides_from_hf({**tiny_config().to_dict(), "use_bidirectional_attention": "vision"})  # published configs: text stays causal
  assert vision == hf_config.overrides_from_hf(tiny_config().to_dict())


@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_transformers(hf_dir, loaded, scan):
  """Longer than the sliding window; per-layer inputs, KV-shared layers, values from keys on the global layers."""
  _, torch_model = hf_dir
  model, config = loaded[scan]
  assert (config.decoder_block, config.num_kv_shared_layers, config.hidden_size_per_layer_input) == ("gemma4", 3, 4)
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 3 * WINDOW - 1)).astype(np.int32)
  np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(torch_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan", [True, False])
def test_greedy_decode_matches_transformers_generate(hf_dir, loaded, scan):
  """Prompts of different lengths in one batch (one longer than the window); shared layers read their sources' caches."""
  _, torch_model = hf_dir
  model, config = loaded[scan]
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (3, 2 * WINDOW + 1)]
  eos = torch_model.config.eos_token_id
  ours = Generator(model, config=config, max_target_length=24, max_prefill_length=16, eos_id=eos).generate(prompts).tokens
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=24 - len(prompt), do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert got == out[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("scan", [True, False])
def test_round_trip_is_bit_exact_and_export_loads_in_transformers(hf_dir, loaded, scan, tmp_path):
  d, torch_model = hf_dir
  model, config = loaded[scan]
  tensors = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(d)
  assert sorted(tensors) == sorted(original)
  for k, v in original.items():
    assert np.array_equal(tensors[k], v), k
  if not scan:
    return
  safetensors_io.write(tmp_path, hf_config_export.hf_config_from(config), tensors)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
  tokens = np.random.default_rng(5).integers(0, VOCAB, size=(2, 11)).astype(np.int32)
  np.testing.assert_array_equal(hf_logits(exported, tokens), hf_logits(torch_model, tokens))


def test_kv_cache_of_shared_layers_is_not_held(hf_dir, loaded):
  """The decode cache line: the 3 shared layers cache nothing, so the cache is smaller than without sharing by exactly
  their keys and values."""
  _, config = loaded[True]
  unshared = config.model_copy(update={"num_kv_shared_layers": 0, "use_double_wide_mlp": False})
  shared_bytes, full_bytes = (cache_layout.theoretical_bytes(c, 1, cache_layout.layout(c, 32)) for c in (config, unshared))
  local, glob = 2 * 2 * 8 * 4, 2 * 1 * 16 * 4  # float32 keys and values per token: sliding (2 heads x 8), global (1 x 16)
  assert full_bytes - shared_bytes == WINDOW * local + 2 * 32 * glob  # layer 4 (sliding ring of WINDOW), layers 5, 6 (global)
  line = cache_layout.describe(config, 1, cache_layout.layout(config, 32))
  assert f"KV cache: {shared_bytes / 2**20:,.2f} MiB" in line and "the 3 KV-shared layers cache nothing" in line
  assert sum(x.nbytes for g in cache_layout.zeros(config, 1, cache_layout.layout(config, 32)).scan for d in g for x in d.values()) == shared_bytes


def test_gemma4_31b_parameter_count_matches_the_published_size():
  """Counted on the abstract model (nothing allocated): gemma4-31b is published as 30.7B parameters; gemma4-e2b has
  transformers' Gemma4ForCausalLM count (4,628,569,344, counted on the meta device) plus its 35 layer scalars (a
  buffer there)."""
  big = counting.param_count(load(["configs/base.yml", "model_name=gemma4-31b"], env={}, num_devices=1))
  small = counting.param_count(load(["configs/base.yml", "model_name=gemma4-e2b", "scan_layers=false"], env={}, num_devices=1))
  table = 262_144 * 35 * 256  # the per-layer input embedding table: Gemma's "effective" size leaves it out (E2B: 2.3B)
  print(f"gemma4-31b: {big / 1e9:.3f}B parameters; gemma4-e2b: {small / 1e9:.3f}B, {(small - table) / 1e9:.3f}B without the per-layer table")
  assert big == pytest.approx(30.7e9, rel=0.015)
  assert small == 4_628_569_344 + 35


def test_model_files_build_their_layer_kinds():
  c = load(["configs/base.yml", "model_name=gemma4-e2b"], env={}, num_devices=1)
  kinds = registry.get(c.decoder_block).kinds(c)
  assert [i for i, k in enumerate(kinds) if k.variant == "global"] == [4, 9, 14, 19, 24, 29, 34]
  assert [i for i, k in enumerate(kinds) if k.kv_shared] == list(range(15, 35))
  lay = cache_layout.layout(c, 1024)
  assert lay.forms.count("kv_shared") == 20 and lay.forms.count("kv_global") == 3


def test_layer_types_contradicting_the_layer_count_is_one_line_exit_2(tmp_path):
  hf = tmp_path / "hf"
  saved(str(hf))
  cfg = json.loads((hf / "config.json").read_text())
  (hf / "config.json").write_text(json.dumps({**cfg, "layer_types": cfg["layer_types"][:5]}))
  run = tmp_path / "run"
  run.mkdir()
  proc, before, after = _run_case([*CONVERT, "--hf-dir", "{tmp}/hf"], hf.parent, run, "")
  assert_one_line_exit_2(proc, "lists 5 layer_types for num_hidden_layers=7")
  assert before == after and not (tmp_path / "converted").exists()


@pytest.mark.parametrize(
  "edit, message",
  [
    (dict(num_kv_shared_layers=7), "num_kv_shared_layers=7 for num_hidden_layers=7, which leaves no layer to compute keys and values"),
    (dict(num_kv_shared_layers=5), "shares every full_attention layer"),
    (dict(layer_types=TYPES[:3] + ["full_attention"] + TYPES[4:]), "fix layer_types"),
    (dict(enable_moe_block=True), "enable_moe_block=true without num_experts, top_k_experts, moe_intermediate_size"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=5, moe_intermediate_size=8), "top_k_experts=5 for num_experts=4"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    (dict(per_layer_config={"2": {"head_dim": 16}}), "not the same head_dim/num_key_value_heads on every full_attention layer"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0}}), "rope_parameters.sliding_attention.rope_type 'yarn'"),
  ],
)
def test_bad_hf_configs_are_one_line_errors(edit, message):
  fields = {**tiny_config().to_dict(), **edit}
  with pytest.raises(ConfigError, match=message):
    hf_config.overrides_from_hf(fields)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(num_kv_shared_layers=7), "num_kv_shared_layers=7 leaves none of the 7 layers"),
    (dict(num_kv_shared_layers=5), r"layer 2 \(global\) shares the keys and values of an earlier global layer, but every global layer is shared"),
    (dict(num_experts=4, num_experts_per_tok=2), "gemma4's experts run beside each layer's dense MLP of mlp_dim, its one shared expert; set shared_experts=1"),
    (dict(mhc_expansion_rate=2), "set mhc_expansion_rate=1"),
    (dict(mtp_num_layers=1), "multi-token prediction is not built for gemma4's layers"),
    (dict(vocab_size=128), r"vocab_size_per_layer_input=97 leaves token ids 97\.\.127 of vocab_size=128 without a per-layer input row"),
  ],
)
def test_bad_maxtext_configs_are_one_line_errors(overrides, message):
  tiny = hf_config.overrides_from_hf(tiny_config().to_dict())
  with pytest.raises(ConfigError, match=message):
    from_overrides(**{**tiny, **overrides, "num_devices": 1})


def test_gemma4_keys_on_another_family_are_refused():
  with pytest.raises(ConfigError, match="num_kv_shared_layers, use_double_wide_mlp apply to gemma4 layers, not decoder_block=llama2"):
    load(["configs/base.yml", "num_kv_shared_layers=2", "use_double_wide_mlp=true"], env={}, num_devices=1)


def test_multimodal_gemma4_directory_loads_its_text_decoder(tmp_path):
  """A Gemma4ForConditionalGeneration directory (text_config, language_model tensors beside a vision tower): the text
  decoder loads and gives the multimodal model's text-only logits."""
  torch.manual_seed(0)
  vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8)
  config = transformers.Gemma4Config(text_config=tiny_config().to_dict(), vision_config=vision.to_dict(), audio_config=None)
  torch_model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
  torch_model.save_pretrained(tmp_path)
  model, _ = from_hf(tmp_path, dtype="float32", matmul_precision="highest")
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(1, 9)).astype(np.int32)
  with torch.no_grad():
    expected = torch_model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
  np.testing.assert_allclose(np.asarray(model(tokens)), expected, atol=1e-4, rtol=0)
