"""LoRA adapter ids are an argument of the call that reads them (issue 35, item 6): one jitted function, traced once,
gives each adapter's output for the ids it is handed, with no context manager around it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext import platform
from maxtext.models import common_specs, specs
from maxtext.models.decoder_layer import DecoderLayer
from tests.test_lora_multi import MULTI, _with_random_b
from tests.test_models import tiny


def test_one_jitted_layer_follows_the_adapter_ids_it_is_handed():
  config = tiny("llama2", lora=MULTI)
  layer = _with_random_b(DecoderLayer(specs.model(config).layer, policy=platform.resolve(config), rngs=nnx.Rngs(0)), seed=1)
  graphdef, state = nnx.split(layer)
  x = jax.random.normal(jax.random.key(2), (2, 8, config.emb_dim), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
  window = common_specs.family_of(config).layer_windows(config)[0]

  @jax.jit
  def run(state: nnx.State, ids: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(x, positions, None, window, adapter_ids=ids)[0]

  every_row = {slot: np.asarray(run(state, jnp.full((2,), slot, jnp.int32))) for slot in (-1, 0, 1, 2)}
  mixed = np.asarray(run(state, jnp.asarray([2, 0], jnp.int32)))
  per_token = np.asarray(run(state, jnp.asarray([[1] * 4 + [-1] * 4] * 2, jnp.int32)))
  assert run._cache_size() == 2  # one trace per ids shape ([B] and [B, S]); the ids' values are not baked in
  for a, b in ((-1, 0), (0, 1), (1, 2), (0, 2)):  # each slot (and the base model, -1) gives its own output
    assert np.abs(every_row[a] - every_row[b]).max() > 1e-3, (a, b)
  np.testing.assert_array_equal(mixed[0], every_row[2][0])  # row 0 on slot 2, row 1 on slot 0, in one call
  np.testing.assert_array_equal(mixed[1], every_row[0][1])
  # per-token ids: the first half of each row on slot 1; causal attention keeps those positions' outputs slot 1's
  np.testing.assert_allclose(per_token[:, :4], every_row[1][:, :4], rtol=0, atol=1e-5)
  assert np.abs(per_token[:, 4:] - every_row[1][:, 4:]).max() > 1e-3


def test_adapted_router_takes_each_rows_adapter():
  """The MoE router sees tokens, not rows: each token gets its row's adapter (several rows in one call)."""
  config = tiny("mixtral", lora={**MULTI, "lora_module_path": "mlp/gate$"})
  layer = _with_random_b(DecoderLayer(specs.model(config).layer, policy=platform.resolve(config), rngs=nnx.Rngs(0)), seed=3)
  x = jax.random.normal(jax.random.key(4), (2, 8, config.emb_dim), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))

  def run(ids: jax.Array) -> np.ndarray:
    return np.asarray(layer(x, positions, None, 0, adapter_ids=ids)[0])

  slot = {s: run(jnp.full((2,), s, jnp.int32)) for s in (0, 2)}
  mixed = run(jnp.asarray([2, 0], jnp.int32))
  assert np.abs(slot[0] - slot[2]).max() > 1e-4  # the router's adapters change the routing weights
  np.testing.assert_allclose(mixed[0], slot[2][0], rtol=0, atol=1e-6)
  np.testing.assert_allclose(mixed[1], slot[0][1], rtol=0, atol=1e-6)
