"""The whole model's KV cache: how layers group into scanned stacks, its shapes, shardings and size.

The layout follows the family's layer pattern (maxtext.models.layer_pattern): a model has one or two layer stacks
(DeepSeek: its dense first layers, then the MoE layers). With scan_layers=true a stack's layer kinds, windows
included, repeat with some period p (1 for uniform models, 2 for gemma2 and gpt_oss, 6 for gemma3; a multiple of
the block of a pattern that mixes layer structures). Decoding scans over groups of p consecutive layers; position j
of a group has its own stacked cache [num_groups, B, K, T_j, D], so each layer keeps a cache of its own length and
form (a ring of sliding_window_size slots for local layers). Layers after the last whole group (and every layer with
scan_layers=false) keep unstacked caches in `tail`.

What a layer caches per token: keys and values of each kv head (grouped-query attention); for MLA, with
mla_naive_kvcache=true, keys and values of every head, else the compressed latent and the shared rotary key
(kv_lora_rank + qk_rope_head_dim values, one "head"). With quantize_kvcache (grouped-query attention only) keys
and values are kv_quant_dtype, each with a scale per token (and per kv head with kv_quant_axis=dkv).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxtext import mesh as mesh_lib
from maxtext.config import MaxTextConfig
from maxtext.inference import kv_cache
from maxtext.layers.dtypes import bits, dtype
from maxtext.models import layer_pattern, registry
from maxtext.models.family import LayerKind

STACK_AXIS = "cache_layers"
INDEXED = "+index"
COMPRESSED = "compressed:"  # DeepSeek V4's forms: 'compressed:<rate>', and '+index' for a CSA layer (maxtext.layers.compressed_attention)  # the suffix of a sparse MLA layer's form: MLA's buffers plus 'index_key' [B, 1, T, indexer_head_dim]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeCache:
  """Per layer stack: scan holds, per group position j, {name: [num_groups, B, K, T_j, D]}; tail, per leftover layer,
  {name: [B, K, T, D]}. lengths [B]: tokens cached per row. A quantized cache adds {'key_scale', 'value_scale'}
  [..., B, K or 1, T, 1]."""

  scan: tuple[tuple[dict[str, jax.Array], ...], ...]
  tail: tuple[tuple[dict[str, jax.Array], ...], ...]
  lengths: jax.Array


@dataclasses.dataclass(frozen=True)
class Stack:
  name: str  # the model's attribute holding these layers: 'layers', or 'dense_layers' (DeepSeek's first layers)
  windows: tuple[int, ...]  # sliding window per layer (0 = global)
  period: int  # layers per scanned group (0 when nothing is scanned)
  num_groups: int
  forms: tuple[str, ...] = ()  # each layer's cache form (cache_form)
  pattern: layer_pattern.Stack | None = None  # the model's stack: where each layer's parameters sit

  @property
  def tail_layers(self) -> range:
    return range(self.period * self.num_groups, len(self.windows))


@dataclasses.dataclass(frozen=True)
class Layout:
  stacks: tuple[Stack, ...]
  max_length: int  # slots of a global layer: max_target_length
  form: str  # every layer's form when they share one, else 'mixed' (each layer's: Stack.forms)

  @property
  def windows(self) -> tuple[int, ...]:
    return tuple(w for s in self.stacks for w in s.windows)

  @property
  def forms(self) -> tuple[str, ...]:
    return tuple(f for s in self.stacks for f in s.forms)

  def slots(self, window: int) -> int:
    """Slots of a layer with this span: a ring of its sliding window or chunk (-span), else max_length."""
    return min(abs(window), self.max_length) if window else self.max_length


def cache_form(config: MaxTextConfig, mixer: str, kind: LayerKind | None = None) -> str:
  """What a layer with this token mixer caches: 'kv' (keys and values per kv head), 'mla_naive' (keys and values per
  head), 'mla_latent' (MLA's compressed latent), 'gdn_state' (a Gated DeltaNet layer's fixed-size state: its
  convolution window and recurrent state, whatever the sequence length); for a layer of this kind (Gemma 4):
  'kv_global' (keys and values of a global layer's own head dims), 'kv_shared' (nothing: the layer reads the cache of
  the last earlier unshared layer with its window)."""
  if kind is not None and kind.kv_shared:
    return "kv_shared"
  if kind is not None and mixer == "attention" and kind.variant == "global" and registry.get(config.decoder_block).gemma4_keys:
    return "kv_global"
  if mixer == "gated_deltanet":
    return "gdn_state"
  if mixer == "attention":
    return "kv"
  if mixer == "mla":
    return "mla_naive" if config.mla_naive_kvcache else "mla_latent"
  if mixer == "mla_sparse":  # MLA's cache plus the lightning indexer's keys
    return cache_form(config, "mla") + INDEXED
  if mixer == "compressed" and kind is not None:  # DeepSeek V4: its window ring, and with a compress rate its compressed stream
    return f"{COMPRESSED}{kind.compress}" + (INDEXED if kind.variant == "compressed_sparse_attention" else "")
  raise ValueError(f"no decode cache form for token mixer {mixer!r}")


def layout(config: MaxTextConfig, max_length: int | None = None) -> Layout:
  stacks = []
  for stack in layer_pattern.stacks(registry.get(config.decoder_block).kinds(config)):
    listed = stack.period > 1 and stack.name != layer_pattern.MAIN_STACK  # a prefix of several structures runs unscanned
    p = layer_pattern.decode_period(stack) if config.scan_layers and not listed else 0
    forms = tuple(cache_form(config, k.mixer, k) for k in stack.kinds)
    stacks.append(Stack(stack.name, stack.windows, p, len(stack.kinds) // p if p else 0, forms, stack))
  forms = {f for s in stacks for f in s.forms}
  return Layout(tuple(stacks), max_length or config.max_target_length, forms.pop() if len(forms) == 1 else "mixed")


def layer_shapes(config: MaxTextConfig, lay: Layout, batch: int, window: int, form: str) -> dict[str, tuple[int, ...]]:
  """One layer's cache buffers and their [B, K, T, D] shapes."""
  c, slots = config, lay.slots(window)
  if form.startswith(COMPRESSED):
    return compressed_shapes(config, lay, batch, window, form)
  if form.endswith(INDEXED):
    return {**layer_shapes(config, lay, batch, window, form.removesuffix(INDEXED)), "index_key": (batch, 1, slots, c.indexer_head_dim)}
  if form == "gdn_state":
    channels = 2 * c.gdn_num_key_heads * c.gdn_key_head_dim + c.gdn_num_value_heads * c.gdn_value_head_dim
    return {"conv": (batch, c.gdn_conv_kernel_dim - 1, channels), "recurrent": (batch, c.gdn_num_value_heads, c.gdn_key_head_dim, c.gdn_value_head_dim)}
  if form == "mla_latent":
    return {"latent": (batch, 1, slots, c.kv_lora_rank + c.qk_rope_head_dim)}
  if form == "mla_naive":
    h = c.num_query_heads
    return {"key": (batch, h, slots, c.qk_nope_head_dim + c.qk_rope_head_dim), "value": (batch, h, slots, c.v_head_dim)}
  if form == "kv_shared":
    return {}
  heads, d = kv_dims(c, form)
  d = d // 2 if stored_dtype(c) == kv_cache.PACKED_INT4 else d
  shapes = {"key": (batch, heads, slots, d), "value": (batch, heads, slots, d)}
  if c.quantize_kvcache:
    scale = (batch, heads if c.kv_quant_axis == "dkv" else 1, slots, 1)
    shapes.update(key_scale=scale, value_scale=scale)
  return shapes


def _compressed_rate(form: str) -> tuple[int, bool]:
  """A DeepSeek V4 form -> (its compress rate, 0 for sliding only; whether it is CSA: overlapping, with the indexer)."""
  return int(form.removeprefix(COMPRESSED).removesuffix(INDEXED)), form.endswith(INDEXED)


def compressed_shapes(config: MaxTextConfig, lay: Layout, batch: int, window: int, form: str) -> dict[str, tuple[int, ...]]:
  """A DeepSeek V4 layer's buffers: 'kv', the ring of its window's keys-and-values [B, 1, window, head_dim]; with a
  compress rate m, 'entries' [B, 1, max_length // m, head_dim] and the projections of the tokens whose window may not
  be pooled yet, 'comp_kv' and 'comp_gate' [B, 1, m (CSA: 2 m), head_dim (CSA: 2 head_dim)]; CSA adds its indexer's
  'index_entries' and 'index_kv', 'index_gate' at indexer_head_dim."""
  c = config
  rate, csa = _compressed_rate(form)
  shapes = {"kv": (batch, 1, lay.slots(window), c.head_dim)}
  if rate:
    ring, wide = (2 * rate, 2) if csa else (rate, 1)
    shapes.update(
      comp_kv=(batch, 1, ring, wide * c.head_dim), comp_gate=(batch, 1, ring, wide * c.head_dim), entries=(batch, 1, lay.max_length // rate, c.head_dim)
    )
  if csa:
    d = c.indexer_head_dim
    shapes.update(index_kv=(batch, 1, 2 * rate, 2 * d), index_gate=(batch, 1, 2 * rate, 2 * d), index_entries=(batch, 1, lay.max_length // rate, d))
  return shapes


def kv_dims(config: MaxTextConfig, form: str) -> tuple[int, int]:
  """(kv heads, head dim) a layer of this key/value form caches: a Gemma 4 global layer's own, else the model's."""
  c = config
  if form == "kv_global":
    return c.global_num_kv_heads or c.num_kv_heads, c.global_head_dim or c.head_dim
  return c.num_kv_heads, c.head_dim


def kv_dtype(config: MaxTextConfig) -> jnp.dtype:
  """The cache's key/value dtype: kv_quant_dtype with quantize_kvcache, else the compute dtype."""
  return jnp.dtype(config.kv_quant_dtype if config.quantize_kvcache else dtype(config.dtype))


def stored_dtype(config: MaxTextConfig) -> jnp.dtype:
  """The key/value buffers' dtype: kv_dtype, with int4 packed two per byte in uint8 (kv_cache.PACKED_INT4)."""
  dt = kv_dtype(config)
  return kv_cache.PACKED_INT4 if dt == jnp.int4 else dt


def scale_heads(config: MaxTextConfig) -> int:
  """Scales per token of a quantized cache's keys (or values): one per kv head (kv_quant_axis=dkv) or one."""
  return config.num_kv_heads if config.kv_quant_axis == "dkv" else 1


def abstract(config: MaxTextConfig, batch: int, lay: Layout) -> DecodeCache:
  """ShapeDtypeStructs of an empty cache (in config.dtype; quantized keys and values in kv_quant_dtype)."""
  dt, quantized = dtype(config.dtype), stored_dtype(config)

  def buffers(s: Stack, i: int, lead: tuple[int, ...] = ()) -> dict[str, jax.ShapeDtypeStruct]:
    shapes = layer_shapes(config, lay, batch, s.windows[i], s.forms[i]).items()
    return {name: jax.ShapeDtypeStruct(lead + shape, buffer_dtype(name)) for name, shape in shapes}

  def buffer_dtype(name: str) -> jnp.dtype:
    if name == "recurrent":
      return jnp.dtype(jnp.float32)  # the delta rule's state accumulates in float32
    return dt if name.endswith("_scale") or name == "conv" else quantized

  scan = tuple(tuple(buffers(s, j, (s.num_groups,)) for j in range(s.period)) for s in lay.stacks)
  tail = tuple(tuple(buffers(s, i) for i in s.tail_layers) for s in lay.stacks)
  return DecodeCache(scan, tail, jax.ShapeDtypeStruct((batch,), jnp.int32))


def logical_axes(cache: DecodeCache) -> DecodeCache:
  """Logical axis names of every cache array (MaxText's cache_* names; a stacked cache adds cache_layers)."""
  return DecodeCache(
    tuple(tuple({k: (STACK_AXIS, *kv_cache.axes(k, x.shape[1:])) for k, x in g.items()} for g in stack) for stack in cache.scan),
    tuple(tuple({k: kv_cache.axes(k, x.shape) for k, x in t.items()} for t in stack) for stack in cache.tail),
    ("cache_batch",),
  )


def shardings(config: MaxTextConfig, mesh: Mesh, cache: DecodeCache) -> DecodeCache:
  """NamedShardings of the cache under the config's logical_axis_rules."""
  is_axes = lambda x: isinstance(x, tuple) and len(x) > 0 and all(isinstance(a, str | None) for a in x)  # noqa: E731
  return jax.tree.map(lambda axes: NamedSharding(mesh, mesh_lib.logical_to_spec(axes, config.logical_axis_rules, mesh)), logical_axes(cache), is_leaf=is_axes)


def zeros(config: MaxTextConfig, batch: int, lay: Layout) -> DecodeCache:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract(config, batch, lay))


def nbytes(cache: DecodeCache) -> tuple[int, int]:
  """(bytes of the cached keys and values or latents, with their scales when quantized; bytes of the per-row lengths)."""
  buffers = [x for groups in (*cache.scan, *cache.tail) for g in groups for x in g.values()]
  return sum(int(np.prod(x.shape)) * bits(x.dtype) // 8 for x in buffers), int(np.prod(cache.lengths.shape)) * 4


def values_per_slot(config: MaxTextConfig, form: str) -> int:
  """Values one layer caches per token: 2 kv_heads head_dim; MLA naive: heads (qk + v head dims); MLA latent:
  kv_lora_rank + qk_rope_head_dim (576 for DeepSeek V3, against 128 x (192 + 128) naive); a Gated DeltaNet state: 0
  (its size does not grow with the tokens: state_bits)."""
  c = config
  if form.endswith(INDEXED):
    return values_per_slot(config, form.removesuffix(INDEXED)) + c.indexer_head_dim
  if form in ("gdn_state", "kv_shared"):
    return 0
  if form == "kv_global":
    heads, d = kv_dims(c, form)
    return 2 * heads * d
  if form == "mla_latent":
    return c.kv_lora_rank + c.qk_rope_head_dim
  if form == "mla_naive":
    return c.num_query_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
  return 2 * c.num_kv_heads * c.head_dim


def bits_per_slot(config: MaxTextConfig, form: str) -> int:
  """Bits one layer of this cache form stores per token: values_per_slot x bits per value + scales x bits per scale."""
  kv_form = form in ("kv", "kv_global")
  per_slot = values_per_slot(config, form) * bits(kv_dtype(config) if kv_form else dtype(config.dtype))
  if kv_form and config.quantize_kvcache:
    per_slot += 2 * scale_heads(config) * bits(dtype(config.dtype))
  return per_slot


def theoretical_bytes(config: MaxTextConfig, batch: int, lay: Layout, form: str | None = None) -> int:
  """batch x sum over layers of slots x bits_per_slot of the layer's form / 8 (form: another cache form for the MLA
  layers, e.g. MLA's naive)."""
  forms = [(form + (INDEXED if f.endswith(INDEXED) else "")) if form and f.startswith("mla") else f for f in lay.forms]
  if any(f.startswith(COMPRESSED) for f in forms):  # DeepSeek V4: the buffers' own sizes (a window ring, entries, projections)
    per_value = bits(dtype(config.dtype))
    return sum(int(np.prod(shape)) for w, f in zip(lay.windows, forms) for shape in compressed_shapes(config, lay, batch, w, f).values()) * per_value // 8
  return batch * sum(lay.slots(w) * bits_per_slot(config, f) + state_bits(config, f) for w, f in zip(lay.windows, forms)) // 8


def state_bits(config: MaxTextConfig, form: str) -> int:
  """Bits of one row's fixed-size state in a layer of this form (a Gated DeltaNet layer's window and float32 state; 0 else)."""
  if form != "gdn_state":
    return 0
  c = config
  channels = 2 * c.gdn_num_key_heads * c.gdn_key_head_dim + c.gdn_num_value_heads * c.gdn_value_head_dim
  return (c.gdn_conv_kernel_dim - 1) * channels * bits(dtype(c.dtype)) + c.gdn_num_value_heads * c.gdn_key_head_dim * c.gdn_value_head_dim * 32


def describe(config: MaxTextConfig, batch: int, lay: Layout) -> str:
  """The KV cache size line: bytes, per-token values, for MLA the naive form's size beside the compressed one, and
  the part of linear-attention layers' fixed-size states."""
  size = theoretical_bytes(config, batch, lay)
  if any(f.startswith(COMPRESSED) for f in lay.forms):
    return _describe_compressed(config, batch, lay, size)
  growing = [f for f in dict.fromkeys(lay.forms) if f not in ("gdn_state", "kv_shared")] or ["gdn_state"]
  per_layer = "/".join(f"{values_per_slot(config, f):,}" for f in growing)
  line = (
    f"KV cache: {size / 2**20:,.2f} MiB for batch {batch} x {lay.max_length} tokens over {len(lay.windows)} layers "
    f"({per_layer} values per token and layer, {kv_dtype(config).name}"
    f"{f' with {2 * scale_heads(config)} scales' if config.quantize_kvcache else ''})"
  )
  shared = lay.forms.count("kv_shared")
  if shared:
    line += f"; the {shared} KV-shared layers cache nothing (they attend over an earlier layer's cache)"
  states = lay.forms.count("gdn_state")
  if states:
    fixed = batch * states * state_bits(config, "gdn_state") // 8
    line += f"; {fixed / 2**20:,.2f} MiB of it the {states} Gated DeltaNet layers' fixed-size state, the same at every length"
  if {"mla_latent", "mla_latent" + INDEXED} & set(lay.forms):
    naive = theoretical_bytes(config, batch, lay, "mla_naive")
    line += f"; per-head keys and values (mla_naive_kvcache=true) would take {naive / 2**20:,.2f} MiB ({naive / size:.1f}x)"
  return line


def _describe_compressed(config: MaxTextConfig, batch: int, lay: Layout, size: int) -> str:
  """DeepSeek V4's KV cache line: its size, against a dense cache of one head_dim key-and-value per token and layer (as
  MLA's latent cache holds every token: what V4's sliding window and compression save)."""
  c = config
  dense = batch * lay.max_length * len(lay.windows) * c.head_dim * bits(dtype(c.dtype)) // 8
  rates = sorted({_compressed_rate(f)[0] for f in lay.forms} - {0})
  return (
    f"KV cache: {size / 2**20:,.2f} MiB for batch {batch} x {lay.max_length} tokens over {len(lay.windows)} layers "
    f"(DeepSeek V4: a {c.sliding_window_size}-token window per layer, compressed entries every {'/'.join(map(str, rates))} tokens, "
    f"{dtype(c.dtype).name}); a dense cache of every token's {c.head_dim}-value key-and-value (as MLA's) would take {dense / 2**20:,.2f} MiB "
    f"({dense / size:.1f}x)"
  )
