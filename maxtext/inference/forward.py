"""The decoder's forward pass over a KV cache: prefill (S tokens per row) or one decode step (S = 1)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.inference.cache_layout import DecodeCache, Layout, Stack
from maxtext.inference.kv_cache import LayerCache
from maxtext.layers.residual import collapse_streams
from maxtext.models import layer_pattern
from maxtext.models.decoder import Transformer
from maxtext.vision.qwen3_vl_encoder import deepstack_add


def group_layers(state: Any, p: int, n: int) -> Any:
  """Stacked layer arrays [L, ...] -> their first n groups of p consecutive layers [n, p, ...] (what a grouped scan steps over)."""
  return jax.tree.map(lambda a: (a if a.shape[0] == n * p else a[: n * p]).reshape(n, p, *a.shape[1:]), state)


def _layer(graphdef: nnx.GraphDef, state: nnx.State, index) -> nnx.Module:
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))


def hidden_states(
  model: Transformer,
  tokens: jax.Array,
  new_lengths: jax.Array,
  cache: DecodeCache,
  lay: Layout,
  adapter_ids: jax.Array | None = None,
  images: Any = None,
  rope_deltas: jax.Array | None = None,
) -> tuple[jax.Array, DecodeCache]:
  """tokens [B, S] (row b's first new_lengths[b] are real) at positions cache.lengths + 0.. -> (final hidden [B, S, E], cache).

  adapter_ids [B]: each row's LoRA slot when lora.max_lora_adapters > 1 (-1: the base model; None: slot 0 for all),
  handed to every layer. images [B, M, S_img, S_img, 3] (a prefill of a use_multimodal model): each row's images,
  placed at its placeholders (Transformer.input_stream); Qwen3-VL's (a Qwen3VLImages) bring their rope positions and
  DeepStack features. rope_deltas [B] (Qwen3-VL, decode steps after a prefill with images): each row's rope position
  minus its cache position. Each layer stack runs in turn (see _run_stack).
  """
  positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
  x, extras = model.multimodal_inputs(tokens, images)
  rope = extras.get("rope_positions")
  if rope is None and rope_deltas is not None:
    rope = jnp.repeat((positions + rope_deltas[:, None])[..., None], 3, axis=-1)
  rot = {} if rope is None else {"rope_positions": rope}
  deep = extras.get("deepstack")
  image_ids = model.image_ids(tokens, images)
  per_layer = model.per_layer_inputs(tokens)  # [layers, B, S, P] (Gemma 4) or None
  if model.hashed:  # hash-routed layers pick experts by token id (DeepSeek V4)
    rot["token_ids"] = tokens

  def run(layer, h, window: int, buffers: dict[str, jax.Array], kind=None, shared=None, per_layer_input=None):
    """One layer over its cache -> (h, its updated buffers). shared (a stack with KV-shared layers): window -> the
    cache and keys/values of the last unshared layer with that window, which a KV-shared layer attends over."""
    extra = {} if per_layer_input is None else {"per_layer_input": per_layer_input}
    if kind is not None and kind.kv_shared:
      source_buffers, kv = shared[window]
      h, _, _ = layer(
        h,
        positions,
        None,
        window,
        cache=LayerCache(source_buffers, cache.lengths, new_lengths, image_ids),
        adapter_ids=adapter_ids,
        shared_kv=kv,
        **extra,
        **rot,
      )
      return h, {}
    layer_cache = LayerCache(buffers, cache.lengths, new_lengths, image_ids)
    if shared is None:
      h, _, out = layer(h, positions, None, window, cache=layer_cache, adapter_ids=adapter_ids, **extra, **rot)
    else:
      h, _, out, kv = layer(h, positions, None, window, cache=layer_cache, adapter_ids=adapter_ids, return_kv=True, **extra, **rot)
      shared[window] = (buffers, kv)
    return h, out.arrays

  scanned, tails = [], []
  for stack, scan_cache, tail_cache in zip(lay.stacks, cache.scan, cache.tail):
    start = stack.pattern.start if stack.pattern is not None else 0
    mine = None if per_layer is None else per_layer[start : start + len(stack.windows)]
    after = None if deep is None else (lambda i, h, start=start: deepstack_add(h, start + i, deep))
    x, s, t = _run_stack(model, stack, x, scan_cache, tail_cache, run, mine, after)
    scanned.append(s)
    tails.append(t)
  hidden = model.final_norm(model.hyper_head(x) if model.hyper_head is not None else collapse_streams(x, model.specs.residual))
  return hidden, DecodeCache(tuple(scanned), tuple(tails), cache.lengths + new_lengths)


def _run_stack(
  model: Transformer, stack: Stack, x: jax.Array, scan_cache: tuple, tail_cache: tuple, run, per_layer: jax.Array | None = None, after=None
) -> tuple[jax.Array, tuple, tuple]:
  """One layer stack: scanned models scan over groups of `stack.period` layers, the stacked caches riding along as scan
  inputs and outputs; the rest of the layers run one by one. A stack with KV-shared layers never repeats, so its
  shared layers find their sources' caches within one group (or among the unscanned layers). after(i, h): what
  follows the stack's layer i (Qwen3-VL's DeepStack addition), or None."""
  source = _LayerSource(model, stack)
  kinds = stack.pattern.kinds if stack.pattern is not None else (None,) * len(stack.windows)
  sharing = any(k is not None and k.kv_shared for k in kinds)
  scanned = ()
  if stack.period:
    p = stack.period

    def body(h, xs):
      group_states, buffers, inputs, group = xs
      new, shared = [], {} if sharing else None
      for j in range(p):
        h, out = run(source.in_group(group_states, j), h, stack.windows[j], buffers[j], kinds[j], shared, None if inputs is None else inputs[j])
        if after is not None:
          h = after(group * p + j, h)
        new.append(out)
      return h, tuple(new)

    grouped = None if per_layer is None else per_layer[: p * stack.num_groups].reshape(stack.num_groups, p, *per_layer.shape[1:])
    groups = jnp.arange(stack.num_groups, dtype=jnp.int32)
    x, scanned = jax.lax.scan(body, x, (source.groups(p, stack.num_groups), scan_cache, grouped, groups))
  tail, shared = [], {} if sharing else None
  for t, i in enumerate(stack.tail_layers):
    x, out = run(source.layer(i), x, stack.windows[i], tail_cache[t], kinds[i], shared, None if per_layer is None else per_layer[i])
    if after is not None:
      x = after(i, x)
    tail.append(out)
  return x, scanned, tuple(tail)


class _LayerSource:
  """Where each layer of a stack keeps its parameters: a list of layers (scan_layers=false), one stacked layer (a
  uniform stack), or `block` stacked layers, one per block position, plus the remainder's (a pattern mixing layer
  structures: maxtext.models.layer_pattern)."""

  def __init__(self, model: Transformer, stack: Stack):
    layers = getattr(model, stack.name)
    self.pattern = stack.pattern
    listed = not model.spec.scan_layers or (self.pattern is not None and self.pattern.period > 1 and stack.name != layer_pattern.MAIN_STACK)
    self.listed = layers if listed else None  # unscanned, or a prefix of several structures (maxtext.models.decoder)
    self.block = self.pattern.period if self.listed is None else 1
    self.parts = [] if self.listed is not None else [nnx.split(m) for m in layers] if self.block > 1 else [nnx.split(layers)]
    self.remainder = model.layers_remainder

  def layer(self, i: int) -> nnx.Module:
    """Layer i of the stack."""
    if self.listed is not None:
      return self.listed[i]
    j, index = self.pattern.locate(i) if self.block > 1 else (0, i)
    if j is None:
      return self.remainder[index]
    return _layer(*self.parts[j], index)

  def groups(self, p: int, n: int) -> tuple:
    """What the scan over n groups of p layers steps over: per block position, its stacked parameters [n, p / block, ...]."""
    m = p // self.block
    return tuple(group_layers(state, m, n) for _, state in self.parts)

  def in_group(self, group_states: tuple, j: int) -> nnx.Module:
    """Layer j of a group, from the scan's slice of groups()."""
    return _layer(self.parts[j % self.block][0], group_states[j % self.block], j // self.block)
