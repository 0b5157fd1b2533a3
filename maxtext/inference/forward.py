"""The decoder's forward pass over a KV cache: prefill (S tokens per row) or one decode step (S = 1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.inference.cache_layout import DecodeCache, Layout
from maxtext.inference.kv_cache import LayerCache
from maxtext.layers import lora
from maxtext.layers.residual import collapse_streams
from maxtext.models.decoder import Transformer


def _layer(graphdef: nnx.GraphDef, state: nnx.State, index) -> nnx.Module:
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))


def hidden_states(
  model: Transformer, tokens: jax.Array, new_lengths: jax.Array, cache: DecodeCache, lay: Layout, adapter_ids: jax.Array | None = None
) -> tuple[jax.Array, DecodeCache]:
  """tokens [B, S] (row b's first new_lengths[b] are real) at positions cache.lengths + 0.. -> (final hidden [B, S, E], cache).

  adapter_ids [B]: each row's LoRA slot when lora.max_lora_adapters > 1 (-1: the base model; None: slot 0 for all).
  """
  with lora.adapter_rows(adapter_ids):
    return _hidden_states(model, tokens, new_lengths, cache, lay)


def _hidden_states(model: Transformer, tokens: jax.Array, new_lengths: jax.Array, cache: DecodeCache, lay: Layout) -> tuple[jax.Array, DecodeCache]:
  """hidden_states within the adapter rows' context.

  Scanned models scan over groups of `lay.period` layers, the stacked caches riding along as scan inputs and
  outputs; the rest of the layers run one by one.
  """
  c = model.config
  positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
  x = model.input_stream(tokens)

  def run(layer, h, window: int, kv: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    h, _, out = layer(h, positions, None, window, cache=LayerCache.of(kv, cache.lengths, new_lengths))
    return h, out.arrays()

  tail = []
  if c.scan_layers:
    graphdef, state = nnx.split(model.layers)
    p, n = lay.period, lay.num_groups
    grouped = jax.tree.map(lambda a: (a if a.shape[0] == n * p else a[: n * p]).reshape(n, p, *a.shape[1:]), state)

    def body(h, xs):
      group_state, kvs = xs
      new = []
      for j in range(p):
        h, kv = run(_layer(graphdef, group_state, j), h, lay.windows[j], kvs[j])
        new.append(kv)
      return h, tuple(new)

    x, scanned = jax.lax.scan(body, x, (grouped, cache.scan))
    for t, i in enumerate(lay.tail_layers):
      x, kv = run(_layer(graphdef, state, i), x, lay.windows[i], cache.tail[t])
      tail.append(kv)
  else:
    scanned = ()
    for i, layer in enumerate(model.layers):
      x, kv = run(layer, x, lay.windows[i], cache.tail[i])
      tail.append(kv)
  hidden = model.final_norm(collapse_streams(x, c))
  return hidden, DecodeCache(scanned, tuple(tail), cache.lengths + new_lengths)
