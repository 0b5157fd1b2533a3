"""The decoder-only Transformer: embedding, stacked (scanned) or looped layers, final norm, logits."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.errors import ConfigError
from maxtext.layers import context_parallel
from maxtext.layers.embed import Embed
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.output_head import OutputHead
from maxtext.layers.residual import collapse_streams, expand_streams
from maxtext.layers.sharding import constrain
from maxtext.models import layer_pattern, pipeline, remat
from maxtext.models.decoder_layer import DecoderLayer, LayerSpec
from maxtext.models.mtp import MTPBlock
from maxtext.models.remat import tied_to_carry
from maxtext.models.specs import DecoderSpec
from maxtext.platform import Policy

LAYERS_AXIS = pipeline.LAYERS_AXIS
OUTSIDE_AXIS = pipeline.OUTSIDE_AXIS
DENSE_LAYERS_AXIS = layer_pattern.PREFIX_STACK  # DeepSeek's leading dense layers: a stack of their own, outside any pipeline


def _prepend_axis(variable: nnx.Variable, name: str) -> nnx.Variable:
  axes = variable.get_metadata().get("logical_axes") or (None,) * (variable[...].ndim - 1)
  return variable.replace(logical_axes=(name,) + tuple(axes))


def stacked_layers(spec: LayerSpec, policy: Policy, keys: jax.Array, axis: str) -> DecoderLayer:
  """One DecoderLayer whose parameters have a leading axis named `axis`, one layer per random key in keys."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLayer(spec, policy=policy, rngs=nnx.Rngs(0))))
  state = jax.vmap(lambda k: nnx.state(DecoderLayer(spec, policy=policy, rngs=nnx.Rngs(k))))(keys)
  state = jax.tree.map(lambda v: _prepend_axis(v, axis), state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.merge(graphdef, state)


def main_stacks(plan: pipeline.Plan | None, spec: LayerSpec, policy: Policy, rngs: nnx.Rngs, num_layers: int) -> tuple[DecoderLayer, DecoderLayer | None]:
  """The main stack's num_layers layers (those after first_num_dense_layers), stacked: (axis 'layers', the layers
  after them on axis 'layers_outside_pipeline', or None).

  Without a pipeline 'layers' holds them all. With one it holds the first pipeline_parallel_layers, sharded over
  `stage`, in the pipeline's train-state order; the rest, if any, form the second stack, not split by stage. Each
  layer gets the random key of its plain index, so every layout starts with the same weights.
  """
  keys = jax.random.split(rngs.params(), num_layers)
  if plan is None:
    return stacked_layers(spec, policy, keys, LAYERS_AXIS), None
  pipelined = stacked_layers(spec, policy, keys[: plan.layers][plan.order()], LAYERS_AXIS)
  return pipelined, stacked_layers(spec, policy, keys[plan.layers :], OUTSIDE_AXIS) if plan.outside else None


def block_stacks(stack: layer_pattern.Stack, layer_specs: tuple[LayerSpec, ...], policy: Policy, rngs: nnx.Rngs) -> tuple[nnx.List, nnx.List | None]:
  """A stack whose structures repeat with period p > 1, scanned: (p stacked layers on axis stack.name, position j
  holding layers j, j + p, ...; the remainder's layers one by one, or None). Layer i gets the i-th random key."""
  p, g = stack.period, stack.num_groups
  keys = jax.random.split(rngs.params(), len(stack.kinds))
  block = nnx.List([stacked_layers(layer_specs[j], policy, keys[j : g * p : p], stack.name) for j in range(p)])
  rest = [DecoderLayer(layer_specs[i], policy=policy, rngs=nnx.Rngs(keys[i])) for i in range(g * p, len(stack.kinds))]
  return block, nnx.List(rest) if rest else None


class Transformer(nnx.Module):
  """Decoder-only LM. model(tokens) -> float32 logits [B, S, vocab]. policy: the target platform's kernels and numerics."""

  def __init__(self, spec: DecoderSpec, *, policy: Policy, rngs: nnx.Rngs):
    c = spec
    self.spec = spec
    self.policy = policy
    self.specs = s = spec.model
    kw = dense_kwargs(policy, rngs)
    # Tied tables also produce the logits: unit-variance rows would give logits of std sqrt(emb_dim) at init.
    tied_scale = 1.0 if (c.normalize_embedding_logits or not c.logits_via_embedding) else c.emb_dim**-0.5
    self.embed = Embed(c.vocab_size, c.emb_dim, init_std=tied_scale, dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=rngs)
    self.stacks = layer_pattern.stacks(s.kinds)  # the pattern's layer stacks (dense_layers, layers), bottom to top
    built: dict[str, Any] = {}
    for stack in self.stacks:
      stack_specs = s.layers[stack.start : stack.start + len(stack.kinds)]
      if not c.scan_layers:
        built[stack.name] = nnx.List([DecoderLayer(spec, policy=policy, rngs=rngs) for spec in stack_specs])
      elif stack.period > 1:
        if stack.name == layer_pattern.MAIN_STACK and s.pipeline is not None:
          raise ConfigError(
            f"decoder_block={c.decoder_block} repeats a block of {stack.period} different layers, which the pipeline does not run; set ici/dcn_pipeline_parallelism=1"
          )
        built[stack.name], built[layer_pattern.REMAINDER] = block_stacks(stack, stack_specs, policy, rngs)
      elif stack.name == layer_pattern.MAIN_STACK:
        built[stack.name], built["layers_outside_pipeline"] = main_stacks(s.pipeline and s.pipeline.plan, stack_specs[0], policy, rngs, len(stack.kinds))
      else:
        built[stack.name] = stacked_layers(stack_specs[0], policy, jax.random.split(rngs.params(), len(stack.kinds)), stack.name)
    self.dense_layers = built.get(layer_pattern.PREFIX_STACK)
    self.layers = built[layer_pattern.MAIN_STACK]
    self.layers_outside_pipeline = built.get("layers_outside_pipeline")  # no pipeline without scanned layers
    self.layers_remainder = built.get(layer_pattern.REMAINDER)  # a block stack's layers after its last whole group (a prefix has one structure)
    self.final_norm = RMSNorm.of(c.emb_dim, s.norm, policy.dtypes)
    # The output kernel stays in weight_dtype; quantize_logits_proj quantizes its product (output_head).
    self.output = None if c.logits_via_embedding else DenseGeneral((c.emb_dim,), (c.vocab_size,), ("embed", "vocab"), **{**kw, "quant": None})
    mtp_policy = dataclasses.replace(policy, quantization=None)  # MaxText's quantize_mtp=false: the MTP modules stay unquantized
    self.mtp = nnx.List([MTPBlock(s.layer, c.remat_policy, policy=mtp_policy, rngs=rngs) for _ in range(c.mtp_num_layers)]) if c.mtp_num_layers else None

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings as the first layer sees them (scaled by sqrt(emb_dim) for Gemma)."""
    x = self.embed(tokens)
    if self.spec.scale_embedding:
      x = x * jnp.asarray(math.sqrt(self.spec.emb_dim), x.dtype)
    return x

  def input_stream(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, S] -> the residual stream state entering the first layer ([B, S, E], or [B, S, n, E] with mHC)."""
    x = constrain(self.embed_tokens(tokens), ("activation_batch", "activation_length", "activation_embed"), self.spec.rules)
    return expand_streams(x, self.specs.residual)

  def hidden_states(
    self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """tokens [B, S] -> (final-normed hidden [B, S, E], weighted MoE load-balance loss)."""
    hidden, _, stats = self.forward_hidden(tokens, positions, segment_ids, adapter_ids)
    return hidden, stats["lb_loss"]

  def _run_layers(
    self,
    layers: nnx.Module,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    windows: list[int],
    adapter_ids: jax.Array | None = None,
    stacked: bool | None = None,
  ):
    """A stack (scanned; stacked defaults to scan_layers) or list of layers over x -> (x, per-layer MoE statistics
    stacked on a leading axis).

    Scanned layers take their window as a scan input when windows differ (gemma2, gemma3, gpt_oss): attention then
    switches between one kernel per window (attention_ops.attend). Scanning over groups of the windows' period
    instead (decoding does, for its per-layer caches) measured far more TPU memory in training: XLA copied each
    group position's slice of every stacked weight out of the loop (benchmarks/README.md).
    """
    c = self.spec
    stacked = c.scan_layers if stacked is None else stacked
    offload = self.policy.offload_layer_inputs

    def layer_fn(graphdef: nnx.GraphDef, layer_state: Any, h: jax.Array, window: int | jax.Array):
      h = checkpoint_name(h, remat.LAYER_INPUT)  # before any other use of h, so an offloaded input is the only copy kept
      layer = nnx.merge(graphdef, tied_to_carry(layer_state, h, self.policy.dtypes.compute) if stacked else layer_state)
      return layer(h, positions, segment_ids, window, adapter_ids=adapter_ids)

    if stacked:
      graphdef, state = nnx.split(layers)
      static_window = windows[0] if len(set(windows)) == 1 else None

      def body(h, xs):
        layer_state, window = xs
        return layer_fn(graphdef, layer_state, h, static_window if static_window is not None else window)

      body = remat.wrap(body, c.remat_policy, prevent_cse=False, offload_input=offload)
      return jax.lax.scan(body, x, (state, jnp.asarray(windows, jnp.int32)))
    per_layer = []
    for layer, window in zip(layers, windows):
      graphdef, state = nnx.split(layer)
      step = remat.wrap(lambda h, st, w=window, g=graphdef: layer_fn(g, st, h, w), c.remat_policy, prevent_cse=True, offload_input=offload)
      x, stats = step(x, state)
      per_layer.append(stats)
    return x, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)

  def _run_stack(self, stack: layer_pattern.Stack, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, adapter_ids: jax.Array | None):
    """One of the pattern's stacks over x -> (x, per-layer MoE statistics, bottom to top)."""
    layers = getattr(self, stack.name)
    if not self.spec.scan_layers or stack.period == 1:
      return self._run_layers(layers, x, positions, segment_ids, list(stack.windows), adapter_ids)
    x, stats = self._run_block(stack, layers, x, positions, segment_ids, adapter_ids)
    rest = self.layers_remainder
    if rest is None:
      return x, stats
    x, after = self._run_layers(rest, x, positions, segment_ids, [k.window for k in stack.remainder], adapter_ids, stacked=False)
    return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, after)

  def _run_block(
    self, stack: layer_pattern.Stack, block: nnx.List, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, adapter_ids: jax.Array | None
  ):
    """A repeating block of p layers of different structures (p stacks of num_groups layers each), scanned group by
    group -> (x, per-layer statistics of the whole groups, in layer order). A block position whose window is the same
    in every group gets it as a constant, otherwise as a scan input."""
    c, p, g = self.spec, stack.period, stack.num_groups
    offload, compute = self.policy.offload_layer_inputs, self.policy.dtypes.compute
    graphdefs, states = zip(*(nnx.split(m) for m in block))
    windows = np.asarray(stack.windows[: g * p], np.int32).reshape(g, p)
    static = [int(windows[0, j]) if len(set(windows[:, j].tolist())) == 1 else None for j in range(p)]

    def position(j: int, window: int | jax.Array):
      def step(h, layer_state):
        h = checkpoint_name(h, remat.LAYER_INPUT)
        return nnx.merge(graphdefs[j], tied_to_carry(layer_state, h, compute))(h, positions, segment_ids, window, adapter_ids=adapter_ids)

      return remat.wrap(step, c.remat_policy, prevent_cse=False, offload_input=offload)

    def body(h, xs):
      group_states, group_windows = xs
      out = []
      for j in range(p):
        h, aux = position(j, static[j] if static[j] is not None else group_windows[j])(h, group_states[j])
        out.append(aux)
      return h, jax.tree.map(lambda *a: jnp.stack(a), *out)

    x, stats = jax.lax.scan(body, x, (tuple(states), jnp.asarray(windows)))
    return x, jax.tree.map(lambda a: a.reshape(g * p, *a.shape[2:]), stats)

  def forward_hidden(
    self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """tokens [B, S] -> (final-normed hidden [B, S, E], hidden before the final norm, MoE statistics).

    Statistics: lb_loss (load-balance loss x load_balance_loss_weight / num_decoder_layers, summed over layers),
    dropped (routed pairs dropped over capacity, summed over layers), load [MoE layers, num_experts].
    adapter_ids [B] or [B, S]: the LoRA slot of each row or token when lora.max_lora_adapters > 1 (None: slot 0).
    """
    c = self.spec
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = self.input_stream(tokens)
    *prefix, main = self.stacks
    windows = list(main.windows)
    lb = jnp.zeros((), jnp.float32)
    for stack in prefix:
      x, dense_stats = self._run_stack(stack, x, positions, segment_ids, adapter_ids)
      lb = lb + jnp.sum(dense_stats["lb_loss"])
    schedule = self.specs.pipeline
    if schedule is None:
      x, stats = self._run_stack(main, x, positions, segment_ids, adapter_ids)
    else:
      piped = schedule.plan.layers
      x, stats = schedule(self.layers, x, positions, segment_ids, adapter_ids, windows[:piped], self.policy)
      if self.layers_outside_pipeline is not None:
        x, after = self._run_layers(self.layers_outside_pipeline, x, positions, segment_ids, windows[piped:], adapter_ids)
        stats = {k: jnp.concatenate([stats[k], after[k]]) for k in ("lb_loss", "dropped", "load")}
    x = collapse_streams(x, self.specs.residual)
    hidden = self.final_norm(x)
    lb = (lb + jnp.sum(stats["lb_loss"])) * (c.load_balance_loss_weight / c.num_decoder_layers)
    return hidden, x, {"lb_loss": lb, "dropped": jnp.sum(stats["dropped"]), "load": stats["load"]}

  def output_head(self) -> OutputHead:
    """The map from final hidden states to logits: the output kernel, or the embedding table when tied."""
    c = self.spec
    if self.output is None:
      kernel = self.embed.embedding[...].T
      scale = c.emb_dim**-0.5 if c.normalize_embedding_logits else 1.0
    else:
      kernel, scale = self.output.kernel[...], 1.0
    return OutputHead(
      kernel,
      self.policy.dtypes.compute,
      self.policy.dtypes.precision,
      scale,
      c.final_logits_soft_cap,
      c.rules,
      self.policy.integer_bf16_rounding,
      c.num_vocab_tiling,
      dataclasses.replace(self.policy.quantization, stored=False) if c.quantize_logits_proj else None,
      c.logits_dot_in_fp32,
    )

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Final hidden states [..., E] -> float32 logits [..., vocab]."""
    return self.output_head().logits(hidden)

  def __call__(
    self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None
  ) -> jax.Array:
    """tokens [B, S] -> logits [B, S, vocab], in the sequence layout context parallelism's wrapper gives
    (context_parallel.in_shard_order: the shards' order inside, natural order out)."""
    return context_parallel.in_shard_order(self.specs.context, self._logits)(tokens, positions, segment_ids, adapter_ids)

  def _logits(self, tokens: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None, adapter_ids: jax.Array | None) -> jax.Array:
    hidden, _ = self.hidden_states(tokens, positions, segment_ids, adapter_ids)
    return self.logits(hidden)
