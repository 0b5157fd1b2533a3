"""A family declared only here, with a layer pattern of existing kinds no built-in family has: a dense MLP and a MoE
alternate (two parameter structures, so the layers scan as a block of 2 plus a remainder layer), and sliding-window
and full attention alternate in pairs (so each block position takes its window as a scan input, and decoding groups
4 layers). It builds, trains one step, counts its parameters and decodes, with no edit to maxtext/."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import counting, models
from maxtext.config import from_overrides
from maxtext.inference import cache_layout, forward
from maxtext.inference.unstack import unstack_layers
from maxtext.models import layer_pattern, registry
from maxtext.models.family import Family, LayerKind, LayerShape
from tests.test_decode import full_logits, perturbed
from tests.test_train_helpers import FAST_COMPILE


def interleaved(shape: LayerShape) -> tuple[LayerKind, ...]:
  """Even layers dense, odd layers experts; layers 0, 1 within the sliding window, 2, 3 full, and so on."""
  return tuple(LayerKind("attention", "moe" if i % 2 else "dense", shape.sliding_window_size if i % 4 < 2 else 0) for i in range(shape.num_decoder_layers))


FAMILY = registry.register(Family(name="test_interleaved", hf_model_types=(), layer_pattern=interleaved))

TINY = dict(
  decoder_block=FAMILY.name,
  base_num_decoder_layers=5,  # two whole blocks (dense, MoE) and a dense remainder layer
  sliding_window_size=4,
  base_emb_dim=32,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  head_dim=8,
  base_mlp_dim=48,
  base_moe_mlp_dim=16,
  num_experts=4,
  num_experts_per_tok=2,
  vocab_size=97,
  dtype="float32",
  matmul_precision="highest",
  max_target_length=24,
  max_prefill_predict_length=16,
  num_devices=1,
)


@functools.cache
def built(scan: bool = True):
  config = from_overrides(**TINY, scan_layers=scan)
  model = perturbed(config)
  tokens = np.random.default_rng(0).integers(0, 97, size=(2, 20)).astype(np.int32)
  return config, model, tokens, full_logits(model, tokens)


def test_the_pattern_scans_as_a_block_of_two_and_a_remainder():
  config, model, _, _ = built()
  (stack,) = layer_pattern.stacks(FAMILY.kinds(config))
  assert (stack.period, stack.num_groups, len(stack.remainder)) == (2, 2, 1)
  assert layer_pattern.decode_period(stack) == 4
  paths = {"/".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(nnx.state(model))}
  assert paths["layers/0/mlp/wi_0/kernel"] == (2, 32, 48)  # layers 0 and 2, stacked
  assert paths["layers/1/mlp/wi_0"] == (2, 4, 32, 16)  # layers 1 and 3: experts
  assert paths["layers_remainder/0/mlp/wi_0/kernel"] == (32, 48)  # layer 4
  assert not any(p.startswith(("dense_layers", "layers_outside_pipeline")) for p in paths)


def test_the_scanned_block_computes_what_the_layers_one_by_one_do():
  _, model, tokens, full = built()
  unstacked = unstack_layers(model)
  assert len(unstacked.layers) == 5
  np.testing.assert_allclose(full_logits(unstacked, tokens), full, atol=1e-5, rtol=0)


def test_trains_one_step():
  """One gradient step (the model's cross entropy plus its MoE load-balance loss) lowers the loss on its batch and
  moves the weights of both block positions and of the remainder layer."""
  config, model, tokens, _ = built()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    hidden, lb = nnx.merge(graphdef, params, rest).hidden_states(jnp.asarray(tokens[:, :-1]))
    logits = nnx.merge(graphdef, params, rest).logits(hidden)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(tokens[:, 1:, None]), -1)) + lb

  step = jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)
  before, grads = step(params)
  trained = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
  after, _ = step(trained)
  assert float(after) < float(before)
  flat = dict(nnx.to_flat_state(grads))
  for path in [
    ("layers", 0, "mlp", "wi_0", "kernel"),
    ("layers", 1, "mlp", "wi_0"),
    ("layers", 1, "mlp", "gate", "kernel"),
    ("layers_remainder", 0, "mlp", "wo", "kernel"),
  ]:
    assert np.abs(np.asarray(flat[path][...])).max() > 0, path


def test_counts_follow_the_pattern_and_equal_the_built_tree():
  config, model, _, _ = built()
  built_total = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(model)))
  assert counting.param_count(config) == built_total
  dense, moe = counting.params_per_layer(config, dense=True), counting.params_per_layer(config)
  assert moe - dense == 4 * 3 * 32 * 16 + 32 * 4 - 3 * 32 * 48  # experts and router instead of the dense MLP
  outside_layers = 97 * 32 * 2 + 32  # embedding, output kernel, final norm
  assert counting.param_count(config) == 3 * dense + 2 * moe + outside_layers
  assert counting.param_count(config, active_only=True) == 3 * dense + 2 * counting.params_per_layer(config, active_only=True) + outside_layers
  assert counting.attended_keys(config) == 4 + 4 + 24 + 24 + 4


def test_greedy_decode_over_the_patterns_caches_matches_the_full_forward():
  """Prefill and greedy decode steps through the scanned block's grouped caches (4 layers a group, 4-slot rings that
  wrap) give the full forward pass's logits over the decoded sequences, and each decoded token is their argmax."""
  config, model, tokens, _ = built()
  lay = cache_layout.layout(config)
  (stack,) = lay.stacks
  assert (stack.period, stack.num_groups, tuple(stack.tail_layers)) == (4, 1, (4,))
  cache = cache_layout.zeros(config, 2, lay)
  assert [g["key"].shape[3] for g in cache.scan[0]] == [4, 4, 24, 24] and cache.tail[0][0]["key"].shape[2] == 4
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, cache, tokens, lengths):
    m = nnx.merge(graphdef, state)
    hidden, cache = forward.hidden_states(m, tokens, lengths, cache, lay)
    return m.logits(hidden), cache

  lengths = np.array([5, 9], np.int32)
  sequences = np.where(np.arange(20) < lengths[:, None], tokens, 0)
  logits, cache = run(state, cache, sequences[:, :16], lengths)
  decoded = [np.asarray(logits)[[0, 1], lengths - 1]]
  for i in range(8):
    sequences[[0, 1], lengths + i] = decoded[-1].argmax(-1)
    logits, cache = run(state, cache, jnp.asarray(sequences[[0, 1], lengths + i])[:, None], np.ones(2, np.int32))
    decoded.append(np.asarray(logits)[:, 0])
  full = full_logits(model, sequences)
  for i, step_logits in enumerate(decoded):
    np.testing.assert_allclose(step_logits, full[[0, 1], lengths - 1 + i], atol=1e-5, rtol=0)
  for i in range(8):
    assert np.array_equal(sequences[[0, 1], lengths + i], full[[0, 1], lengths - 1 + i].argmax(-1))


@pytest.mark.parametrize("bad", [dict(ici_pipeline_parallelism=2, num_devices=2, pipeline_parallel_layers=4)])
def test_a_block_of_different_layers_refuses_the_pipeline(bad):
  from maxtext.errors import ConfigError

  config = from_overrides(**{**TINY, **bad})
  with pytest.raises(ConfigError, match="num_layers_per_pipeline_stage 1 is not a multiple of 2"):
    models.abstract_model(config)
