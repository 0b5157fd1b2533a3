"""Qwen3-Next (family qwen3_next): Gated DeltaNet layers and gated full attention in a 3 + 1 pattern, experts beside a
gated shared expert, converted from and compared with transformers' Qwen3NextForCausalLM (tiny, random, float32, eager)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from maxtext import counting, from_hf
from maxtext.convert import hf_config, hf_config_export, hf_params, safetensors_io
from maxtext.convert.model_params import flat_params
from maxtext.errors import ConfigError
from maxtext.inference import Generator, cache_layout
from maxtext.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec
from maxtext.models import layer_pattern, registry
from tests.hf_fixtures import away_from_init, hf_logits
from tests.test_gated_deltanet import POLICY
from tests.test_train_helpers import FAST_COMPILE

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
  away_from_init(model)
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
  model, config = from_hf(d, scan_layers=scan, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK)
  ours = Generator(model, config=config, max_target_length=24, max_prefill_length=16, eos_id=eos).generate(prompts).tokens
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
  line = cache_layout.describe(config, 1, cache_layout.layout(config, 64))
  assert "the 4 Gated DeltaNet layers' fixed-size state, the same at every length" in line and "(32 values per token and layer" in line


def test_flops_count_gated_deltanet_scores_within_a_chunk(hf_dir):
  """Training FLOPs: a Gated DeltaNet layer scores each token against its chunk, not against the whole sequence."""
  d, _ = hf_dir
  _, config = from_hf(d, dtype="float32", gdn_chunk_size=CHUNK, max_target_length=64)
  assert counting.attended_keys(config) == 4 * CHUNK + 64  # four linear layers, one full-attention layer


def test_gradients_through_packed_documents(hf_dir):
  """Gradients over packed rows (segment ids reset the linear layers' state) reach the Gated DeltaNet parameters of
  every linear layer, the gated attention and the shared expert's gate."""
  d, _ = hf_dir
  model, _ = from_hf(d, dtype="float32", matmul_precision="highest", gdn_chunk_size=CHUNK, remat_policy="full")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, size=(2, 2 * CHUNK + 5)), jnp.int32)
  segments = jnp.asarray([[1] * 9 + [2] * 11 + [0], [1] * 21], jnp.int32)

  def loss(params):
    m = nnx.merge(graphdef, params, rest)
    hidden, _ = m.hidden_states(tokens[:, :-1], segment_ids=segments[:, :-1])
    logp = jax.nn.log_softmax(m.logits(hidden))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

  flat = dict(nnx.to_flat_state(jax.jit(jax.grad(loss), compiler_options=FAST_COMPILE)(params)))
  paths = [("layers", j, "attention", name) for j in range(3) for name in ("A_log", "dt_bias", "conv", "in_proj_qkvz", "in_proj_ba")]
  paths += [("layers_remainder", 0, "attention", "A_log"), ("layers", 3, "attention", "query"), ("layers_remainder", 0, "mlp", "shared_expert_gate")]
  for path in paths:
    g = np.asarray(next(v for k, v in flat.items() if k[: len(path)] == path)[...])
    assert np.isfinite(g).all() and np.abs(g).max() > 0, path


def test_gated_deltanet_gradients_equal_finite_differences():
  """The chunked form's gradients (packed rows, chunks of 4 over 11 tokens) equal central finite differences."""
  spec = GatedDeltaNetSpec(emb_dim=16, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=4, chunk_size=4)
  layer = GatedDeltaNet(spec, policy=POLICY, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 11, 16)), jnp.float32)
  seg = jnp.asarray([[1] * 5 + [2] * 6, [1] * 9 + [0] * 2], jnp.int32)
  weights = jnp.asarray(np.random.default_rng(4).normal(size=(2, 11, 16)), jnp.float32)
  graphdef, params = nnx.split(layer)

  def loss(params):
    return jnp.sum(nnx.merge(graphdef, params)(x, seg) * weights)

  grads = dict(nnx.to_flat_state(jax.jit(jax.grad(loss), compiler_options=FAST_COMPILE)(params)))
  loss = jax.jit(loss, compiler_options=FAST_COMPILE)  # 14 evaluations below: compiled once, not op by op
  for path in [("A_log",), ("dt_bias",), ("conv",), ("in_proj_qkvz", "kernel"), ("in_proj_ba", "kernel"), ("norm", "scale"), ("out_proj", "kernel")]:
    g = np.asarray(grads[path][...])
    eps, unit = 1e-3, g / np.linalg.norm(g)

    def moved(sign, path=path, unit=unit, eps=eps):
      return nnx.from_flat_state([(k, v.replace(v[...] + sign * eps * unit) if k == path else v) for k, v in nnx.to_flat_state(params)])

    numeric = (float(loss(moved(1))) - float(loss(moved(-1)))) / (2 * eps)
    assert numeric == pytest.approx(np.linalg.norm(g), rel=1e-2), path


def test_round_trip_and_export_load_in_transformers(hf_dir, tmp_path):
  """HF -> maxtext -> HF is bit-identical, and the exported config.json + safetensors give transformers' logits."""
  d, torch_model = hf_dir
  model, config = from_hf(d, dtype="float32")
  tensors = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(d)
  assert sorted(tensors) == sorted(original)
  for k, v in original.items():
    assert np.array_equal(tensors[k], v), k
  safetensors_io.write(tmp_path, hf_config_export.hf_config_from(config), tensors)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
  tokens = np.random.default_rng(5).integers(0, 97, size=(2, 2 * CHUNK + 5)).astype(np.int32)
  np.testing.assert_allclose(hf_logits(exported, tokens), hf_logits(torch_model, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(num_devices=2, ici_context_parallelism=2, ici_fsdp_parallelism=1), "set ici/dcn_context_parallelism=1"),
    (dict(num_devices=1, gdn_num_key_heads=3), "gdn_num_value_heads=32 is not a multiple of gdn_num_key_heads=3"),
  ],
)
def test_configs_the_linear_layers_cannot_run_are_config_errors(overrides, message):
  from maxtext.config import from_overrides
  from maxtext.models import specs

  tiny = hf_config.overrides_from_hf(tiny_config().to_dict())
  config = from_overrides(**{**tiny, "gdn_num_value_heads": 32, **overrides})
  with pytest.raises(ConfigError, match=message):
    specs.model(config)


def test_a_sliding_window_the_pattern_has_no_place_for_is_refused():
  from maxtext.config import from_overrides

  tiny = hf_config.overrides_from_hf(tiny_config().to_dict())
  with pytest.raises(ConfigError, match="layer pattern has no sliding-window layer; set it to 0"):
    from_overrides(**{**tiny, "sliding_window_size": 16, "num_devices": 1})
