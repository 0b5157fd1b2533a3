"""Llama 4 (family llama4, text decoder): dense and top-1 MoE layers interleaved (the expert's input weighted by a sigmoid
router score, beside a shared expert), chunked local attention with interleaved rope and an L2 query/key norm on the rope
layers, NoPE global layers with temperature tuning; converted from and compared with transformers' Llama4ForCausalLM
(tiny, random, float32, eager)."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
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
from maxtext.layers import attention_ops
from maxtext.models import layer_pattern, registry
from tests.hf_fixtures import away_from_init, hf_logits
from tests.test_bad_inputs import CONVERT_TO, _run_case, assert_one_line_exit_2

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
    rope_parameters={
      "rope_type": "llama3",
      "rope_theta": 500000.0,
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16,
    },
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
  away_from_init(model)
  model.save_pretrained(tmp)
  return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("llama4")
  return d, saved(str(d))


@pytest.fixture(scope="module")
def converted(hf_dir):
  """(model, config) of the saved checkpoint, scanned, float32: shared by the tests that only read it."""
  return from_hf(hf_dir[0], scan_layers=True, dtype="float32", matmul_precision="highest")


def test_pattern_interleaves_dense_and_moe_with_nope_every_fourth_layer():
  c = from_overrides(**hf_config.overrides_from_hf(tiny_config().to_dict()), num_devices=1)
  kinds = registry.get("llama4").kinds(c)
  assert [k.ffn for k in kinds] == ["dense", "moe_shared"] * 3
  assert [k.span for k in kinds] == [-CHUNK, -CHUNK, -CHUNK, 0, -CHUNK, -CHUNK]
  (stack,) = layer_pattern.stacks(kinds)
  assert (stack.period, stack.num_groups, len(stack.remainder), layer_pattern.decode_period(stack)) == (2, 3, 0, 4)


@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_transformers(hf_dir, converted, scan):
  """13 tokens over chunks of 4: rope layers attend within their chunk, NoPE layers (temperature-tuned from position 3
  on, floor_scale 4) attend to every earlier token; the scanned model takes each layer's span as a scan input."""
  d, torch_model = hf_dir
  tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 3 * CHUNK + 1)).astype(np.int32)
  model, config = converted if scan else from_hf(d, scan_layers=False, dtype="float32", matmul_precision="highest")
  assert (config.decoder_block, config.chunk_attn_window_size, config.nope_layer_interval, config.interleave_moe_layer_step) == ("llama4", CHUNK, 4, 2)
  np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_packed_documents_attend_within_their_own_chunks(converted):
  """Two documents packed in one row (segment ids, positions restarting at 0) give each document's own logits: the
  chunks count from each document's start."""
  model, _ = converted
  rng = np.random.default_rng(3)
  docs = rng.integers(0, VOCAB, size=(2, 6))  # the second starts at index 6, mid-chunk of the row
  packed = jnp.asarray(docs.reshape(1, 12), jnp.int32)
  positions = jnp.asarray(np.tile(np.arange(6), 2)[None], jnp.int32)
  segments = jnp.asarray([[1] * 6 + [2] * 6], jnp.int32)
  hidden, _ = model.hidden_states(packed, positions=positions, segment_ids=segments)
  together = np.asarray(model.logits(hidden))[0]
  alone = np.asarray(model(jnp.asarray(docs, jnp.int32))).reshape(12, -1)
  np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)


def test_greedy_decode_matches_transformers_generate(hf_dir, converted):
  """Prompts of 3 and 9 tokens in one batch decode to transformers' greedy tokens: the chunked layers from rings of
  CHUNK slots, the NoPE layers from full caches (one scanned decode group of 4 layers, then 2 more)."""
  d, torch_model = hf_dir
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (3, 9)]
  eos = torch_model.config.eos_token_id
  model, config = converted
  lay = cache_layout.layout(config, 20)
  assert [lay.slots(w) for w in lay.windows] == [CHUNK, CHUNK, CHUNK, 20, CHUNK, CHUNK]
  ours = Generator(model, config=config, max_target_length=20, max_prefill_length=12, eos_id=eos).generate(prompts).tokens
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=20 - len(prompt), do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert got == out[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"


def test_round_trip_and_export_load_in_transformers(hf_dir, converted, tmp_path):
  """HF -> maxtext -> HF is bit-identical (the experts' fused gate_up halves included), and the exported config.json +
  safetensors give transformers' logits."""
  d, torch_model = hf_dir
  model, config = converted
  tensors = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(d)
  assert sorted(tensors) == sorted(original)
  for k, v in original.items():
    assert np.array_equal(tensors[k], v), k
  exported_config = hf_config_export.hf_config_from(config)
  assert hf_config.overrides_from_hf(exported_config) == hf_config.overrides_from_hf(tiny_config().to_dict()) | {"dtype": "float32"}
  safetensors_io.write(tmp_path, exported_config, tensors)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
  tokens = np.random.default_rng(5).integers(0, VOCAB, size=(2, 3 * CHUNK + 1)).astype(np.int32)
  np.testing.assert_allclose(hf_logits(exported, tokens), hf_logits(torch_model, tokens), atol=1e-5, rtol=0)


def test_multimodal_checkpoint_loads_its_text_decoder(hf_dir):
  """A Llama4ForConditionalGeneration directory with use_multimodal=false: config.json's text_config and the
  language_model.* tensors (the vision tower's left out) convert to the same parameters as the text model's own.
  (Its vision_config sets use_multimodal and the llama4 *_for_vit keys: tests/test_vlm_llama4.py.)"""
  d, _ = hf_dir
  text = tiny_config().to_dict()
  composite = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": text, "vision_config": {"hidden_size": 8}}
  overrides = hf_config.overrides_from_hf(composite)
  assert overrides["use_multimodal"] and overrides["hidden_size_for_vit"] == 8
  overrides = {k: v for k, v in overrides.items() if not k.endswith("_for_vit") and k not in ("use_multimodal", "image_token_id")}
  assert overrides == hf_config.overrides_from_hf(text)
  original = safetensors_io.read_tensors(d)
  renamed = {("language_model." + k if k.startswith("model.") else "language_model.lm_head.weight"): v for k, v in original.items()}
  renamed["vision_model.patch_embedding.weight"] = np.zeros((2, 2), np.float32)
  config = from_overrides(**overrides, num_devices=1)
  ours, theirs = hf_params.hf_to_maxtext(renamed, config), hf_params.hf_to_maxtext(original, config)
  assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("model, total, active", [("llama4-17b-16e", 109e9, 17e9), ("llama4-17b-128e", 400e9, 17e9)])
def test_parameter_counts_match_the_published_sizes(model, total, active):
  """Scout: 109B parameters, 17B active; Maverick: 400B, 17B active (counted from the model files' abstract shapes)."""
  config = load(["configs/base.yml", f"model_name={model}"], env={}, num_devices=1)
  assert counting.param_count(config) == pytest.approx(total, rel=0.015)
  assert counting.param_count(config, active_only=True) == pytest.approx(active, rel=0.015)


@pytest.mark.parametrize(
  "extra, message",
  [
    (dict(no_rope_layers=[1, 1, 1, 0, 1]), "lists 5 no_rope_layers for num_hidden_layers=6"),
    (dict(no_rope_layers=[1, 0, 1, 0, 1, 0]), "no_rope_layers are not layers 3, 7, ... NoPE (no_rope_layer_interval=4)"),
    (dict(moe_layers=[0, 2, 4]), "moe_layers 0, 2, 4 are not the layers 1, 3, ... of 6 that interleave_moe_layer_step=2 makes MoE"),
    (dict(layer_types=["full_attention"] * LAYERS), "fix layer_types"),
    (dict(attention_chunk_size=None), "attention_chunk_size=null (full attention on the rope layers) is not built"),
    (dict(num_experts_per_tok=2), "num_experts_per_tok=2; maxtext's llama4 weights expert inputs for top-1 only"),
  ],
)
def test_bad_configs_are_one_line_errors(extra, message):
  fields = {**tiny_config().to_dict(), **extra}
  with pytest.raises(ConfigError, match=re.escape(message)):
    hf_config.overrides_from_hf(fields)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(decoder_block="llama2", nope_layer_interval=4), "nope_layer_interval=4 shapes llama4's layer pattern"),
    (dict(chunk_attn_window_size=0), "set chunk_attn_window_size > 0"),
    (dict(inhomogeneous_layer_cycle_interval=3), "repeats every 4 layers; set it to 4"),
    (dict(rope_type="default"), "rope_use_scale=false turns off llama3.1 rope's scaling"),
  ],
)
def test_keys_the_pattern_cannot_honour_are_config_errors(overrides, message):
  tiny = {} if "decoder_block" in overrides else hf_config.overrides_from_hf(tiny_config().to_dict())  # llama2: base.yml's keys
  extra = {"rope_use_scale": False} if "rope_type" in overrides else {}
  with pytest.raises(ConfigError, match=re.escape(message)):
    from_overrides(**{**tiny, **extra, **overrides, "num_devices": 1})


def test_chunked_layers_under_context_parallelism_are_refused():
  from maxtext.models import specs

  tiny = hf_config.overrides_from_hf(tiny_config().to_dict())
  config = from_overrides(**tiny, num_devices=2, ici_context_parallelism=2, ici_fsdp_parallelism=1)
  with pytest.raises(ConfigError, match="chunked-attention layers, which context parallelism does not build yet"):
    specs.model(config)


def _bad_hf_dir(path, **text_fields) -> list[str]:
  """A Llama4ForConditionalGeneration config.json (no weights: the config is checked first) -> the convert command."""
  path.mkdir()
  text = {**tiny_config().to_dict(), **text_fields}
  (path / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": text, "vision_config": {}}))
  return [*CONVERT_TO, str(path.parent / "converted"), "--hf-dir", str(path)]


@pytest.mark.parametrize(
  "fields, mention",
  [
    (dict(no_rope_layers=[1, 1, 1, 0]), "lists 4 no_rope_layers for num_hidden_layers=6"),
    (dict(num_experts_per_tok=2), "maxtext's llama4 weights expert inputs for top-1 only"),
  ],
  ids=["no_rope_layers_contradict_the_layer_count", "top2_routing_not_built"],
)
def test_convert_refuses_in_one_line(tmp_path, fields, mention):
  """`python -m maxtext.convert hf-to-maxtext` on such a directory: one line, exit 2, nothing written."""
  work = tmp_path / "work"
  work.mkdir()
  argv = _bad_hf_dir(work / "hf", **fields)
  proc, before, after = _run_case(argv, work, work, "")
  assert_one_line_exit_2(proc, mention)
  assert after == before


def test_every_kernel_chunks_packed_documents_by_their_positions():
  """Chunked local attention (window -16) over rows of three packed documents: the chunked kernel (outputs and
  gradients), splash through attend (Pallas interpret mode; chunks as segment ids) and cuDNN's mask path equal the XLA
  reference."""
  from tests.test_attention_kernels import SCALE, SMALL_BLOCKS, assert_same, forward_and_grads, packed_batch, policy, reference

  q, k, v, seg, pos = packed_batch()
  expected = forward_and_grads(jax.jit(lambda q, k, v: reference(q, k, v, seg, pos, -16, None)), q, k, v)
  causal = reference(q, k, v, seg, pos, 0, None)
  assert not np.allclose(expected[0], causal, atol=1e-3)  # the chunks cut keys the causal mask keeps
  chunked = jax.jit(lambda q, k, v: attention_ops.chunked_attention(q, k, v, pos, pos, seg, -16, SCALE, None, 48))
  assert_same(forward_and_grads(chunked, q, k, v), expected)
  tpu = policy("tpu", splash=SMALL_BLOCKS, interpret_kernels=True)
  kw = dict(q_positions=pos, kv_positions=pos, segment_ids=seg, soft_cap=None, scale=SCALE, policy=tpu)
  splash = attention_ops.attend(q, k, v, window=-16, **kw)
  cudnn = attention_ops.cudnn_attention(q, k, v, attention_ops.chunk_segments(seg, pos, 16), window=0, scale=SCALE, max_segments=0, implementation="xla")
  for out in (splash, cudnn):
    np.testing.assert_allclose(out, expected[0], atol=2e-5, rtol=0)
