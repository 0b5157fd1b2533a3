"""KV-cache decoding: cached logits equal the full forward pass, batching, merged LoRA, sampling sets, no recompiles."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import models
from maxtext.config import from_overrides
from maxtext.inference import cache_layout, forward
from maxtext.inference.generate import Generator, prefill_bucket
from maxtext.inference.lora_merge import merge_lora
from maxtext.inference.sampling import SamplingParams, allowed_logits, sample
from maxtext.inference.unstack import unstack_layers

TINY = dict(
  decoder_block="gemma2",  # alternating sliding-window (ring buffer) and global layers, soft caps, post norms
  sliding_window_size=4,
  attn_logits_soft_cap=50.0,
  final_logits_soft_cap=30.0,
  base_emb_dim=32,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  head_dim=8,
  base_mlp_dim=48,
  base_num_decoder_layers=3,  # scanned: one group of (local, global) + a local tail layer
  vocab_size=97,
  dtype="float32",
  matmul_precision="highest",
  mhc_expansion_rate=4,
  lora={"enable_lora": True, "lora_rank": 4},
  max_target_length=24,
  max_prefill_predict_length=16,
  num_devices=1,
)


def perturbed(config, seed: int = 0):
  """The config's model with every parameter drawn at random (LoRA B and the mHC maps included, which start at zero or
  constants), N(0, 0.1) (gemma2's norms scale by 1 + s). Drawn with numpy, so
  nothing compiles."""
  rng = np.random.default_rng(seed)
  graphdef, abstract = nnx.split(models.abstract_model(config))
  state = jax.tree.map(lambda v: rng.normal(0.0, 0.1, v.shape).astype(v.dtype), abstract)
  return nnx.merge(graphdef, state)


def full_logits(model, tokens):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


@functools.cache
def built(scan: bool):
  """(config, model, generator, tokens [2, 20], the full forward pass's logits over them)."""
  config = from_overrides(**TINY, scan_layers=scan)
  model = perturbed(config)
  gen = Generator(model, config=config, max_target_length=config.max_target_length, max_prefill_length=config.max_prefill_predict_length)
  tokens = np.random.default_rng(0).integers(0, 97, size=(2, 20)).astype(np.int32)
  return config, model, gen, tokens, full_logits(model, tokens)


@pytest.fixture(scope="module", params=[True, False], ids=["scanned", "unscanned"])
def setup(request):
  return built(request.param)


@pytest.fixture(scope="module")
def scanned():
  return built(True)


def test_cached_logits_equal_full_forward(setup):
  config, _, gen, tokens, full = setup
  assert_cached_logits_equal_full_forward(config, gen, tokens, full, steps=10)  # 10 steps: the 4-slot ring buffers wrap twice


def assert_cached_logits_equal_full_forward(config, gen, tokens, full, steps: int) -> None:
  """Prefill rows of 5 and 9 prompt tokens, then `steps` decode steps: every logit equals the full forward pass's
  within 1e-5, and the decode step compiles once."""
  lengths = np.array([5, 9], np.int32)
  prompts = np.where(np.arange(16) < lengths[:, None], tokens[:, :16], 0)

  @jax.jit
  def prefill_all(state, prompts, lengths):
    m = nnx.merge(gen.graphdef, state)
    hidden, cache = forward.hidden_states(m, prompts, lengths, cache_layout.zeros(config, 2, gen.layout), gen.layout)
    return m.logits(hidden), cache

  logits, cache = prefill_all(gen.state, prompts, lengths)
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(logits)[row, :n], full[row, :n], atol=1e-5, rtol=0)
  for i in range(steps):
    cache, step_logits = gen.step(gen.state, cache, jnp.asarray(tokens[[0, 1], lengths + i]))
    expected = full[[0, 1], lengths + i]
    np.testing.assert_allclose(np.asarray(step_logits), expected, atol=1e-5, rtol=0)
  assert gen.step._cache_size() == 1, "decode steps compiled more than once"


def test_mixed_prompt_lengths_equal_each_alone(scanned):
  gen = scanned[2]
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, 97, size=n).tolist() for n in (2, 7, 13)]
  together = gen.generate(prompts).tokens
  alone = [gen.generate([p]).tokens[0] for p in prompts]
  assert together == alone
  assert [len(t) for t in together] == [24 - 2, 24 - 7, 24 - 13], "each row stops at max_target_length"
  gen.generate([prompts[0][:1], prompts[2][:11], prompts[1]])  # other lengths, same bucket and batch: nothing new compiles
  gen.eos_id = alone[1][2]  # EOS is an argument of the compiled loop: the row stops right after emitting it
  assert gen.generate([prompts[1]]).tokens[0] == alone[1][: alone[1].index(alone[1][2]) + 1]
  gen.eos_id = -1
  assert sorted(gen._executables) == [(1, 16, False), (3, 16, False)]


def test_merged_lora_gives_the_same_logits(scanned):
  config, _, _, tokens, full = scanned
  merged = merge_lora(perturbed(config))  # same seed: the weights of the fixture's model, merged in place
  assert not any("lora" in "/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(merged)))
  np.testing.assert_allclose(full_logits(merged, tokens), full, atol=1e-5, rtol=0)


def test_prefill_bucket():
  assert [prefill_bucket(n, 64) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
  assert prefill_bucket(20, 24) == 24


SAMPLES = 20_000


@pytest.mark.parametrize(
  "params",
  [SamplingParams("topk", temperature=0.7, top_k=5), SamplingParams("nucleus", temperature=1.3, nucleus_p=0.6), SamplingParams("weighted", temperature=2.0)],
  ids=["topk", "nucleus", "weighted"],
)
def test_sampling_stays_in_the_allowed_set_with_the_right_frequencies(params):
  logits = jax.random.normal(jax.random.key(1), (50,)) * 2.0
  probs = np.asarray(jax.nn.softmax(logits / params.temperature))
  order = np.argsort(-probs)
  if params.strategy == "topk":
    allowed = set(order[: params.top_k].tolist())
  elif params.strategy == "nucleus":
    before = np.cumsum(probs[order]) - probs[order]
    allowed = set(order[before < params.nucleus_p].tolist())
  else:
    allowed = set(range(50))
  draws = np.asarray(sample(jnp.broadcast_to(logits, (SAMPLES, 50)), jax.random.key(7), params))
  assert set(np.unique(draws).tolist()) <= allowed
  target = np.zeros(50)
  target[list(allowed)] = probs[list(allowed)] / probs[list(allowed)].sum()
  freq = np.bincount(draws, minlength=50) / SAMPLES
  assert np.all(np.abs(freq - target) <= 5 * np.sqrt(target * (1 - target) / SAMPLES) + 1e-9)
  assert set(np.flatnonzero(np.asarray(allowed_logits(logits[None], params))[0] > -1e29).tolist()) == allowed


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.key(3), (4, 30))
  assert np.array_equal(np.asarray(sample(logits, jax.random.key(0), SamplingParams())), np.argmax(np.asarray(logits), -1))


@pytest.mark.parametrize("bad", [dict(strategy="topk", top_k=0), dict(strategy="nucleus", nucleus_p=-1.0), dict(strategy="weighted", temperature=0.0)])
def test_bad_sampling_settings_are_config_errors(bad):
  from maxtext.errors import ConfigError

  with pytest.raises(ConfigError):
    SamplingParams(**bad)


def test_unstacked_layers_give_the_same_logits(scanned):
  _, model, _, tokens, full = scanned
  unstacked = unstack_layers(model)
  assert not unstacked.spec.scan_layers and len(unstacked.layers) == 3
  np.testing.assert_allclose(full_logits(unstacked, tokens), full, atol=1e-5, rtol=0)
