"""Model files load, and their parameter counts match the published model sizes; FLOPs match a hand count."""

from pathlib import Path

import pytest

from maxtext import counting
from maxtext.config import from_overrides, load
from maxtext.models import registry

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs" / "base.yml")

# Published sizes in billions, with a tied output projection counted once (it is one tensor): the Hugging Face
# safetensors totals; for Qwen3-0.6B and 1.7B, whose safetensors also store the tied lm_head, the model-card size.
PUBLISHED_BILLIONS = {
  "llama2-7b": 6.74,
  "llama2-13b": 13.02,
  "llama2-70b": 68.98,
  "llama3-8b": 8.03,
  "llama3.1-8b": 8.03,
  "llama3.1-70b": 70.55,
  "llama3.1-405b": 405.85,
  "mistral-7b": 7.24,
  "mixtral-8x7b": 46.70,
  "qwen3-0.6b": 0.596,
  "qwen3-1.7b": 1.72,  # the model card's 1.7B; HF lists 2.03B because its safetensors store the tied embedding twice
  "qwen3-4b": 4.02,
  "qwen3-8b": 8.19,
  "qwen3-14b": 14.77,
  "qwen3-32b": 32.76,
  "gemma2-2b": 2.61,
  "gemma2-9b": 9.24,
  "gemma2-27b": 27.23,
  "qwen3-30b-a3b": 30.53,
  "qwen3-235b-a22b": 235.09,
  "deepseek3-671b": 671.03,  # the main model; its multi-token-prediction module is counted apart (see below)
  "deepseek3.2-671b": 671.88,  # deepseek3-671b plus 61 lightning indexers (0.85B); its MTP module apart
  "deepseek4-284b": 284.0,  # DeepSeek-V4-Flash's card: 284B total (its MTP layer not built)
  "gemma3-1b": 1.0,
  # Text decoders of the multimodal releases: the published 4.3B / 12.2B / 27.4B include the 0.42B SigLIP vision tower
  # and projector; 27.0B is the text decoder the issue names.
  "gemma3-4b": 4.30 - 0.42,
  "gemma3-12b": 12.2 - 0.42,
  "gemma3-27b": 27.0,
  "gemma4-31b": 30.7,  # the model card's 30.7B (text decoder)
  "gemma4-26b": 25.2,  # Gemma 4 26B A4B's card: 25.2B total, 3.8B active (text decoder)
  "gpt-oss-20b": 20.9,  # openai's model card (also the HF safetensors total with MXFP4 experts counted as weights)
  "gpt-oss-120b": 116.8,
  "qwen2.5-1.5b": 1.54,
  "qwen2.5-7b": 7.62,
  "qwen2.5-14b": 14.77,
  "olmo3-7b": 7.30,  # Olmo 3 sizes: the HF safetensors totals (allenai/Olmo-3-1025-7B, Olmo-3-1125-32B)
  "olmo3-32b": 32.23,
  "mixtral-8x22b": 140.63,
  "llama3.3-70b": 70.55,
  "qwen3-480b-a35b": 480.15,  # Qwen3-Coder-480B-A35B: 480B total, 35B active
  "qwen3-1.7b-base": 1.72,
  "qwen3-4b-base": 4.02,
  "qwen3-8b-base": 8.19,
  "qwen3-14b-base": 14.77,
  "qwen3-30b-a3b-base": 30.53,
  "deepseek2-16b": 15.71,  # DeepSeek-V2-Lite
  "deepseek2-236b": 235.74,
  "qwen3-next-80b-a3b": 80.0,  # the model card's 80B (the HF safetensors also hold its multi-token-prediction layer)
  "llama4-17b-16e": 109.0,  # Scout's card: 109B with its vision encoder, which these text weights leave out
  "llama4-17b-128e": 400.0,  # Maverick's card: 400B
  "qwen3.5-27b": 27.0,  # Qwen3.5 model cards' sizes; the text decoders (the cards' totals also hold a 0.4B vision tower)
  "qwen3.5-35b-a3b": 35.0,
  "qwen3.5-397b-a17b": 397.0,
  "qwen3-vl-30b-a3b": 31.1,  # Qwen3-VL-30B-A3B's card: 31.1B with its vision tower (MaxText's model file, unchanged)
  "gemma-2b": 2.51,  # the HF safetensors totals (google/gemma-2b, google/gemma-7b)
  "gemma-7b": 8.54,
  "llama3-70b": 70.55,
  "llama3-405b": 405.85,  # MaxText's name for the 405B architecture (published as Llama 3.1 405B)
  "olmo3-7b-pt": 7.30,
  "qwen3-4b-thinking-2507": 4.02,
  "deepseek3-671b-2dfsdp": 671.03,  # deepseek3-671b with MaxText's layouts (mesh and sharding keys)
  "deepseek3-671b-batchsplit": 671.03,
}
TOLERANCE = {"llama4-17b-16e": 0.015}  # the card's total counts the vision encoder; the text decoder is 1.1% below it
NOT_PUBLISHED = ("deepseek3-tiny", "kimi-k2-1t")  # a CPU-sized architecture file; Kimi K2's size is published only as "1T, 32B active"
# Gemma 4 E2B/E4B are published by "effective" size (without the per-layer table) or with the vision and audio towers
# (tests/test_gemma4.py checks E2B against transformers' own count).
NOT_PUBLISHED += ("gemma4-e2b", "gemma4-e4b")
NOT_PUBLISHED += ("deepseek3-test",)  # MaxText's test architecture: DeepSeek V3's layers and experts at width 512
NOT_PUBLISHED += ("deepseek4-tiny",)  # MaxText's CPU-sized DeepSeek V4 architecture

# Exact parameter counts known for a few models (qwen3-0.6b: 751,632,384 on HF minus the duplicated 151936 x 1024 lm_head).
EXACT = {
  "llama2-7b": 6_738_415_616,
  "llama3.1-8b": 8_030_261_248,
  "llama3.1-405b": 405_853_388_800,
  "mixtral-8x7b": 46_702_792_704,
  "gemma2-2b": 2_614_341_888,
  "qwen3-0.6b": 596_049_920,
  "qwen3-30b-a3b": 30_532_122_624,
  "qwen3-235b-a22b": 235_093_634_560,
  "gemma3-1b": 999_885_952,
  "qwen2.5-7b": 7_615_616_512,
  "gemma-2b": 2_506_172_416,
  "gemma-7b": 8_537_680_896,
}


def _model(name: str):
  return load([BASE, f"model_name={name}"], env={}, num_devices=1)


def test_every_model_file_is_listed():
  assert sorted(p.stem for p in (ROOT / "configs" / "models").glob("*.yml")) == sorted([*PUBLISHED_BILLIONS, *NOT_PUBLISHED])


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_param_count_matches_published_size(name):
  config = _model(name)
  assert config.model_name == name
  count = counting.param_count(config) - counting.mtp_params(config)
  assert count == pytest.approx(PUBLISHED_BILLIONS[name] * 1e9, rel=TOLERANCE.get(name, 0.01))
  if name in EXACT:
    assert count == EXACT[name]


def test_model_values_reach_the_config():
  qwen = _model("qwen3-0.6b")
  assert (qwen.emb_dim, qwen.num_query_heads, qwen.num_kv_heads, qwen.head_dim, qwen.num_decoder_layers) == (1024, 16, 8, 128, 28)
  assert qwen.use_qk_norm and qwen.logits_via_embedding and qwen.rope_max_timescale == 1e6
  llama = _model("llama3.1-8b")
  assert llama.rope_type == "llama3.1" and llama.rope_scaling_factor == 8.0 and llama.rope_original_max_position_embeddings == 8192
  assert not llama.logits_via_embedding and llama.rope_max_timescale == 500_000.0
  gemma = _model("gemma2-27b")
  assert (gemma.attn_logits_soft_cap, gemma.final_logits_soft_cap, gemma.sliding_window_size, gemma.query_pre_attn_scalar) == (50.0, 30.0, 4096, 144.0)
  assert gemma.mlp_activations == ["gelu", "linear"] and gemma.normalization_layer_epsilon == 1e-6
  mixtral = _model("mixtral-8x7b")
  assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.decoder_block) == (8, 2, "mixtral")
  small, large = _model("qwen2.5-1.5b"), _model("qwen2.5-7b")
  assert small.attention_bias and small.logits_via_embedding and not large.logits_via_embedding and not small.use_qk_norm
  olmo = _model("olmo3-7b")
  assert olmo.use_qk_norm and (olmo.rope_type, olmo.rope_factor, olmo.local_rope_max_timescale, olmo.rope_interleave) == ("yarn", 8, 500_000.0, False)
  assert registry.get("olmo3").layer_windows(olmo)[:8] == [4096, 4096, 4096, 0] * 2


def test_active_params_of_the_largest_moe_files():
  assert counting.param_count(_model("qwen3-480b-a35b"), active_only=True) == pytest.approx(35e9, rel=0.015)
  assert counting.param_count(_model("mixtral-8x22b"), active_only=True) == pytest.approx(39.1e9, rel=0.01)
  assert counting.param_count(_model("gemma4-26b"), active_only=True) == pytest.approx(3.8e9, rel=0.015)


def test_deepseek3_counts_with_its_mtp_module():
  config = _model("deepseek3-671b")
  # HF's 684.5B safetensors total stores the MTP module with its own copies of the embedding and the output head.
  hf_total = counting.param_count(config) + 2 * config.vocab_size * config.emb_dim
  assert hf_total == pytest.approx(684.53e9, rel=0.001)
  assert counting.param_count(config, active_only=True) - counting.mtp_params(config, active_only=True) == pytest.approx(37.5e9, rel=0.01)
  qwen = _model("qwen3-235b-a22b")
  assert counting.param_count(qwen, active_only=True) == pytest.approx(22.2e9, rel=0.01)


def test_kimi_k2_is_1t_with_32b_active():
  config = _model("kimi-k2-1t")
  assert counting.param_count(config) == pytest.approx(1.0e12, rel=0.03)
  assert counting.param_count(config, active_only=True) == pytest.approx(32e9, rel=0.03)


def _hybrid_active_without_embeddings(c) -> int:
  """Qwen3-Next / Qwen3.5-MoE active parameters per token without the embedding table and output head, from the
  architecture's matrices alone (Hugging Face's modeling code; norms, convolution and decay vectors left out)."""
  e, period = c.emb_dim, c.inhomogeneous_layer_cycle_interval
  full = c.num_decoder_layers // period
  gdn = e * (2 * c.gdn_num_key_heads * c.gdn_key_head_dim + 2 * c.gdn_num_value_heads * c.gdn_value_head_dim + 2 * c.gdn_num_value_heads)
  gdn += c.gdn_num_value_heads * c.gdn_value_head_dim * e
  attention = e * (2 * c.num_query_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_query_heads * c.head_dim * e  # q and its gate, k, v; o
  experts = (c.num_experts_per_tok + c.shared_experts) * 3 * e * c.moe_mlp_dim + e * c.num_experts + e  # routed and shared; router, shared gate
  return (c.num_decoder_layers - full) * gdn + full * attention + c.num_decoder_layers * experts


@pytest.mark.parametrize(
  "name, billions",
  [("qwen3-next-80b-a3b", 3.25), ("qwen3.5-35b-a3b", 2.44), ("qwen3.5-397b-a17b", 15.31)],
)
def test_hybrid_active_params(name, billions):
  """Active parameters per token without the embedding table and output head equal the architecture's count (within
  0.5%: the vectors it leaves out). The names' A3B / A17B round these: Qwen3-Next's 3.25B; Qwen3.5's 3.46B and
  17.35B with both vocab x E tables (docs/linear_attention.md)."""
  config = _model(name)
  active = counting.param_count(config, active_only=True) - 2 * config.vocab_size * config.emb_dim
  assert active == pytest.approx(_hybrid_active_without_embeddings(config), rel=0.005)
  assert active == pytest.approx(billions * 1e9, rel=0.005)


def test_tied_embeddings_are_counted_once():
  config = _model("qwen3-1.7b")
  twice = counting.param_count(config) + config.vocab_size * config.emb_dim
  assert twice == pytest.approx(2.03e9, rel=0.005)


def test_gpt_oss_active_params_match_the_model_card():
  """openai's 3.6B and 5.1B active parameters count the experts a token reaches, without the embedding table."""
  for name, active in (("gpt-oss-20b", 3.6e9), ("gpt-oss-120b", 5.1e9)):
    config = _model(name)
    assert counting.param_count(config, active_only=True) - config.vocab_size * config.emb_dim == pytest.approx(active, rel=0.015)


def test_mixtral_active_params():
  config = _model("mixtral-8x7b")
  assert counting.param_count(config, active_only=True) == pytest.approx(12.9e9, rel=0.01)


# A tiny config whose counts are worked out by hand below.
TINY = dict(
  base_emb_dim=8,
  base_num_query_heads=2,
  base_num_kv_heads=1,
  head_dim=4,
  base_mlp_dim=16,
  base_num_decoder_layers=2,
  vocab_size=32,
  max_target_length=16,
  per_device_batch_size=2,
)
# Per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192; gated mlp 3*8*16 = 384; 2 norms of 8 = 16 -> 592.
TINY_LAYER = 592


def test_tiny_param_count_by_hand():
  config = from_overrides(num_devices=1, **TINY)
  assert counting.params_per_layer(config) == TINY_LAYER
  assert counting.param_count(config, include_embedding=False) == 2 * TINY_LAYER + 8
  assert counting.param_count(config) == 2 * TINY_LAYER + 8 + 2 * 32 * 8
  tied = from_overrides(num_devices=1, logits_via_embedding=True, **TINY)
  assert counting.param_count(tied) == 2 * TINY_LAYER + 8 + 32 * 8


def test_tiny_flops_by_hand():
  config = from_overrides(num_devices=4, **TINY)  # 4 devices x 2 sequences x 16 tokens
  tokens = 4 * 2 * 16
  weights = (2 * TINY_LAYER + 8) + 32 * 8
  attention = 6 * tokens * (2 * 16) * 2 * 4  # layers x seq keys, heads x head_dim
  assert counting.training_flops_per_step(config) == 6 * tokens * weights + attention
  assert counting.flops_per_device_per_step(config) == (6 * tokens * weights + attention) / 4
  accumulated = from_overrides(num_devices=4, gradient_accumulation_steps=3, **TINY)
  assert counting.training_flops_per_step(accumulated) == 3 * counting.training_flops_per_step(config)


def test_tiny_gemma2_sliding_window_flops_by_hand():
  config = from_overrides(num_devices=1, decoder_block="gemma2", sliding_window_size=4, **TINY)
  tokens = 2 * 16
  weights = 2 * (TINY_LAYER + 2 * 8) + 8 + 32 * 8  # gemma2: 4 norms per layer
  attention = 6 * tokens * (16 + 4) * 2 * 4  # layer 0 local (4 keys), layer 1 global (16 keys)
  assert counting.training_flops_per_step(config) == 6 * tokens * weights + attention
  mistral = from_overrides(num_devices=1, decoder_block="mistral", sliding_window_size=4, **TINY)  # every layer local
  assert counting.attended_keys(mistral) == 4 + 4


def test_moe_counts_by_hand():
  config = from_overrides(num_devices=1, decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, **TINY)
  attention_and_norms = 192 + 16
  router = 8 * 4
  expert = 3 * 8 * 16
  assert counting.params_per_layer(config) == attention_and_norms + router + 4 * expert
  assert counting.params_per_layer(config, active_only=True) == attention_and_norms + router + 2 * expert


def test_mhc_and_qk_norm_and_lora_counts_by_hand():
  mhc = from_overrides(num_devices=1, mhc_expansion_rate=2, **TINY)
  # n=2, nC=16: W 16*(2+2+4) = 128, biases 2+2+4 = 8, gates 3, norm 16 -> 155 per sub-block, 2 sub-blocks.
  assert counting.mhc_params_per_layer(mhc) == 310
  assert counting.params_per_layer(mhc) == TINY_LAYER + 310
  qk = from_overrides(num_devices=1, use_qk_norm=True, **TINY)
  assert counting.params_per_layer(qk) == TINY_LAYER + 2 * 4
  lora = from_overrides(num_devices=1, lora={"enable_lora": True, "lora_rank": 2}, **TINY)
  # r (in + out): q 2*16, k 2*12, v 2*12, o 2*16, wi_0 2*24, wi_1 2*24, wo 2*24.
  assert counting.lora_params_per_layer(lora) == 32 + 24 + 24 + 32 + 48 + 48 + 48
  attention_only = from_overrides(num_devices=1, lora={"enable_lora": True, "lora_rank": 2, "lora_module_path": "attention/(query|value)$"}, **TINY)
  assert counting.lora_params_per_layer(attention_only) == 32 + 24
