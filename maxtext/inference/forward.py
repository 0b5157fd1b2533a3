"""The decoder's forward pass over a KV cache: prefill (S tokens per row) or one decode step (S = 1)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.inference.cache_layout import DecodeCache, Layout, Stack
from maxtext.inference.kv_cache import LayerCache
from maxtext.layers.residual import collapse_streams
from maxtext.models.decoder import Transformer


def group_layers(state: Any, p: int, n: int) -> Any:
  """Stacked layer arrays [L, ...] -> their first n groups of p consecutive layers [n, p, ...] (what a grouped scan steps over)."""
  return jax.tree.map(lambda a: (a if a.shape[0] == n * p else a[: n * p]).reshape(n, p, *a.shape[1:]), state)


def _layer(graphdef: nnx.GraphDef, state: nnx.State, index) -> nnx.Module:
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))


def hidden_states(
  model: Transformer, tokens: jax.Array, new_lengths: jax.Array, cache: DecodeCache, lay: Layout, adapter_ids: jax.Array | None = None
) -> tuple[jax.Array, DecodeCache]:
  """tokens [B, S] (row b's first new_lengths[b] are real) at positions cache.lengths + 0.. -> (final hidden [B, S, E], cache).

  adapter_ids [B]: each row's LoRA slot when lora.max_lora_adapters > 1 (-1: the base model; None: slot 0 for all),
  handed to every layer. Each layer stack runs in turn (see _run_stack).
  """
  positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
  x = model.input_stream(tokens)

  def run(layer, h, window: int, buffers: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    h, _, out = layer(h, positions, None, window, cache=LayerCache(buffers, cache.lengths, new_lengths), adapter_ids=adapter_ids)
    return h, out.arrays

  scanned, tails = [], []
  for stack, scan_cache, tail_cache in zip(lay.stacks, cache.scan, cache.tail):
    x, s, t = _run_stack(getattr(model, stack.name), stack, x, scan_cache, tail_cache, run)
    scanned.append(s)
    tails.append(t)
  hidden = model.final_norm(collapse_streams(x, model.specs.residual))
  return hidden, DecodeCache(tuple(scanned), tuple(tails), cache.lengths + new_lengths)


def _run_stack(layers, stack: Stack, x: jax.Array, scan_cache: tuple, tail_cache: tuple, run) -> tuple[jax.Array, tuple, tuple]:
  """One layer stack: scanned models scan over groups of `stack.period` layers, the stacked caches riding along as scan
  inputs and outputs; the rest of the layers run one by one."""
  tail = []
  if stack.period:
    graphdef, state = nnx.split(layers)
    p, n = stack.period, stack.num_groups

    def body(h, xs):
      group_state, buffers = xs
      new = []
      for j in range(p):
        h, out = run(_layer(graphdef, group_state, j), h, stack.windows[j], buffers[j])
        new.append(out)
      return h, tuple(new)

    x, scanned = jax.lax.scan(body, x, (group_layers(state, p, n), scan_cache))
    for t, i in enumerate(stack.tail_layers):
      x, out = run(_layer(graphdef, state, i), x, stack.windows[i], tail_cache[t])
      tail.append(out)
    return x, scanned, tuple(tail)
  for i, layer in enumerate(layers):
    x, out = run(layer, x, stack.windows[i], tail_cache[i])
    tail.append(out)
  return x, (), tuple(tail)
