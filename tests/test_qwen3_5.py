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
from maxtext.convert import hf_config, hf_config_export, hf_params, safetensors_io
from maxtext.convert.model_params import flat_params
from maxtext.errors import ConfigError
from maxtext.inference import Generator
from maxtext.models import registry
from tests.hf_fixtures import away_from_init, hf_logits

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
  return transformers.Qwen3_5MoeTextConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, **extra)


@functools.cache
def saved(variant: str, tmp: str) -> transformers.PreTrainedModel:
  """A tiny random Qwen3.5 causal LM saved to tmp, every parameter (norms, A_log, dt_bias) away from its init."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(tiny_config(variant), attn_implementation="eager").float().eval()
  away_from_init(model)
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
  model, config = from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK)
  ours = Generator(model, config=config, max_target_length=32, max_prefill_length=24, eos_id=eos).generate(prompts).tokens
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
  exported_config = hf_config_export.hf_config_from(config)
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


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
  """The tiny MoE checkpoint plus a multi-token-prediction module as Qwen3.5 stores it (mtp.*: the two input norms,
  fc and one full-attention MoE layer, its final norm), every tensor random."""
  base = tmp_path_factory.mktemp("qwen3_5_moe_base")
  torch_model = saved("moe", str(base))
  tensors = safetensors_io.read_tensors(base)
  rng = np.random.default_rng(7)
  mtp = {
    f"mtp.layers.0.{k[len('model.layers.3.') :]}": v + rng.normal(0, 0.05, v.shape).astype(v.dtype)
    for k, v in tensors.items()
    if k.startswith("model.layers.3.")
  }
  mtp["mtp.fc.weight"] = rng.normal(0, 0.2, (32, 64)).astype(np.float32)
  for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    mtp[f"mtp.{name}.weight"] = rng.normal(0, 0.1, (32,)).astype(np.float32)
  config = {**safetensors_io.read_config(base), "mtp_num_hidden_layers": 1}
  out = tmp_path_factory.mktemp("qwen3_5_moe_mtp")
  safetensors_io.write(out, config, {**tensors, **mtp})
  return out, torch_model, mtp


def test_mtp_module_converts_both_ways_and_is_skipped_without_mtp_num_layers(mtp_dir):
  d, torch_model, mtp = mtp_dir
  tokens = np.random.default_rng(0).integers(0, 97, size=(1, 11)).astype(np.int32)
  plain, _ = from_hf(d, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK)  # mtp.* left out
  assert plain.mtp is None
  np.testing.assert_allclose(np.asarray(plain(tokens)), hf_logits(torch_model, tokens), atol=1e-4, rtol=0)
  model, config = from_hf(d, dtype="float32", mtp_num_layers=1)
  tensors = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(d)
  assert sorted(tensors) == sorted(original) and set(mtp) <= set(tensors)
  for k, v in original.items():
    assert np.array_equal(tensors[k], v), k
  assert hf_config_export.hf_config_from(config)["mtp_num_hidden_layers"] == 1
  with pytest.raises(ConfigError, match="set mtp_num_layers=1"):
    from_hf(d, dtype="float32", mtp_num_layers=2)


def test_mtp_module_matches_a_transformers_reference(mtp_dir):
  """h = layer(fc([norm(embedding of the next token); norm(hidden before the final norm)])), then its norm, computed
  with transformers' own Qwen3.5-MoE decoder layer and norms holding the mtp.* weights."""
  from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_mod

  from maxtext.models.mtp import shift_left

  d, torch_model, mtp = mtp_dir
  model, _ = from_hf(d, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK, mtp_num_layers=1)
  tokens = np.random.default_rng(3).integers(0, 97, size=(2, 2 * CHUNK + 5)).astype(np.int32)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  _, pre_norm, _ = model.forward_hidden(tokens)
  ahead = shift_left(tokens, 1)
  _, ours = model.mtp[0](pre_norm, model.embed_tokens(ahead), positions, None, 0)

  cfg = torch_model.config
  layer = hf_mod.Qwen3_5MoeDecoderLayer(cfg, 3).float().eval()
  weights = {k[len("mtp.layers.0.") :]: torch.as_tensor(v) for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
  experts = range(cfg.num_experts)
  expert = {p: torch.stack([weights.pop(f"mlp.experts.{j}.{p}_proj.weight") for j in experts]) for p in ("gate", "up", "down")}
  weights["mlp.experts.gate_up_proj"] = torch.cat([expert["gate"], expert["up"]], dim=1)  # transformers' fused layout
  weights["mlp.experts.down_proj"] = expert["down"]
  layer.load_state_dict(weights)
  norms = {n: hf_mod.Qwen3_5MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
  with torch.no_grad():
    for n, norm in norms.items():
      norm.weight.copy_(torch.as_tensor(mtp[f"mtp.{n}.weight"]))
    emb = torch_model.model.embed_tokens(torch.as_tensor(np.array(ahead), dtype=torch.long))
    hidden = torch.as_tensor(np.asarray(pre_norm))
    x = torch.cat([norms["pre_fc_norm_embedding"](emb), norms["pre_fc_norm_hidden"](hidden)], -1) @ torch.as_tensor(mtp["mtp.fc.weight"]).T
    position_ids = torch.as_tensor(positions, dtype=torch.long)[None].expand(3, -1, -1)
    rope = torch_model.model.rotary_emb(x, position_ids)
    s = tokens.shape[1]
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None].expand(tokens.shape[0], 1, s, s)
    out = layer(x, position_embeddings=rope, attention_mask=mask, position_ids=position_ids[0])
    reference = norms["norm"](out[0] if isinstance(out, tuple) else out).numpy()
  np.testing.assert_allclose(np.asarray(ours), reference, atol=1e-4, rtol=0)


LORA = {
  "enable_lora": True,
  "lora_rank": 4,
  "lora_alpha": 8,
  "lora_module_path": r"(^|/)(attention/(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj|query|key|value|out)|mlp/(wi_0|wi_1|wo))$",
}


@pytest.mark.parametrize("scan", [True, False])
def test_peft_adapters_on_the_linear_and_attention_projections(tmp_path_factory, scan):
  """LoRA on every projection of the Gated DeltaNet and attention layers (scanned: a block of 4 and a remainder layer):
  the PEFT export reproduces our logits in transformers, imports back bit-exactly, and merges into weights that do too."""
  import copy

  import jax
  from flax import nnx

  from maxtext.convert import peft as lora_peft
  from maxtext.layers.lora import LoRAParam

  peft = pytest.importorskip("peft")
  d = tmp_path_factory.mktemp("qwen3_5_peft")
  torch_model = saved("dense", str(d))
  model, config = from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK, lora=LORA)
  for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, LoRAParam))):
    var.set_value(0.3 * jax.random.normal(jax.random.key(i), var.shape))
  flat = {k: np.asarray(v) for k, v in flat_params(model).items()}
  adapters = {k: v for k, v in flat.items() if "/lora/" in k}
  tokens = np.random.default_rng(4).integers(0, 97, size=(2, 2 * CHUNK + 5)).astype(np.int32)
  ours = np.asarray(model(tokens))

  tensors, adapter_config = lora_peft.to_peft(adapters, config)
  assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "o_proj", "up_proj"} <= set(adapter_config["target_modules"])
  assert any(".4.linear_attn.in_proj_qkv." in k for k in tensors) and any(".3.self_attn.q_proj." in k for k in tensors)
  out = d / f"peft_{scan}"
  lora_peft.write(out, tensors, adapter_config)
  wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(out)).eval()
  np.testing.assert_allclose(hf_logits(wrapped, tokens), ours, atol=1e-4, rtol=0)

  back = lora_peft.from_peft(tensors, config, {k: v.shape for k, v in adapters.items()})
  assert sorted(back) == sorted(adapters)
  for k, v in adapters.items():
    assert np.array_equal(back[k], v), k

  merged = hf_params.maxtext_to_hf(lora_peft.merge(flat, config), config)
  exported = copy.deepcopy(torch_model)
  exported.load_state_dict({k: torch.as_tensor(np.array(v)) for k, v in merged.items()})
  np.testing.assert_allclose(hf_logits(exported, tokens), ours, atol=1e-4, rtol=0)


def test_vision_language_config_with_key_heads_not_dividing_value_heads_is_one_line_exit_2(tmp_path):
  """As the user converts a Qwen3.5 vision-language checkpoint (model_type qwen3_5, the decoder in text_config) whose
  linear key heads do not divide its value heads: exit 2, one `error:` line naming both, nothing written."""
  import json
  import shutil

  from tests.test_bad_inputs import CONVERT, _run_case, assert_one_line_exit_2

  src = tmp_path / "src"
  saved("dense", str(src))
  hf = tmp_path / "hf"
  hf.mkdir()
  shutil.copy(src / "model.safetensors", hf / "model.safetensors")
  text = {**json.loads((src / "config.json").read_text()), "linear_num_key_heads": 3}
  (hf / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}))
  run = tmp_path / "run"
  run.mkdir()
  proc, before, after = _run_case([*CONVERT, "--hf-dir", "{tmp}/hf"], tmp_path, run, "")
  assert_one_line_exit_2(proc, "linear_num_value_heads=4, not a multiple of linear_num_key_heads=3")
  assert before == after and not (tmp_path / "converted").exists()
