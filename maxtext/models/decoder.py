"""The decoder-only Transformer: embedding, stacked (scanned) or looped layers, final norm, logits."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.config import MaxTextConfig
from maxtext.layers import context_parallel
from maxtext.layers.embed import Embed
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.output_head import OutputHead
from maxtext.layers.residual import collapse_streams, expand_streams
from maxtext.layers.sharding import constrain
from maxtext.models import pipeline, registry, remat, specs
from maxtext.models.decoder_layer import DecoderLayer, LayerSpec
from maxtext.models.mtp import MTPBlock
from maxtext.models.remat import tied_to_carry
from maxtext.platform import Policy

LAYERS_AXIS = pipeline.LAYERS_AXIS
OUTSIDE_AXIS = pipeline.OUTSIDE_AXIS
DENSE_LAYERS_AXIS = "dense_layers"  # DeepSeek's leading dense layers: a stack of their own, outside any pipeline


def _prepend_axis(variable: nnx.Variable, name: str) -> nnx.Variable:
  axes = variable.get_metadata().get("logical_axes") or (None,) * (variable[...].ndim - 1)
  return variable.replace(logical_axes=(name,) + tuple(axes))


def stacked_layers(spec: LayerSpec, policy: Policy, keys: jax.Array, axis: str) -> DecoderLayer:
  """One DecoderLayer whose parameters have a leading axis named `axis`, one layer per random key in keys."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLayer(spec, policy=policy, rngs=nnx.Rngs(0))))
  state = jax.vmap(lambda k: nnx.state(DecoderLayer(spec, policy=policy, rngs=nnx.Rngs(k))))(keys)
  state = jax.tree.map(lambda v: _prepend_axis(v, axis), state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.merge(graphdef, state)


def main_stacks(config: MaxTextConfig, spec: LayerSpec, policy: Policy, rngs: nnx.Rngs) -> tuple[DecoderLayer, DecoderLayer | None]:
  """The layers after first_num_dense_layers, stacked: (axis 'layers', the layers after them on axis
  'layers_outside_pipeline', or None).

  Without a pipeline 'layers' holds them all. With one it holds the first pipeline_parallel_layers, sharded over
  `stage`, in the pipeline's train-state order; the rest, if any, form the second stack, not split by stage. Each
  layer gets the random key of its plain index, so every layout starts with the same weights.
  """
  keys = jax.random.split(rngs.params(), config.num_decoder_layers - config.first_num_dense_layers)
  plan = pipeline.Plan.of(config)
  if plan is None:
    return stacked_layers(spec, policy, keys, LAYERS_AXIS), None
  pipelined = stacked_layers(spec, policy, keys[: plan.layers][plan.order()], LAYERS_AXIS)
  return pipelined, stacked_layers(spec, policy, keys[plan.layers :], OUTSIDE_AXIS) if plan.outside else None


class Transformer(nnx.Module):
  """Decoder-only LM. model(tokens) -> float32 logits [B, S, vocab]. policy: the target platform's kernels and numerics."""

  def __init__(self, config: MaxTextConfig, *, policy: Policy, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.policy = policy
    self.family = registry.get(c.decoder_block)
    self.specs = s = specs.model(c, self.family)
    kw = dense_kwargs(policy, rngs)
    # Tied tables also produce the logits: unit-variance rows would give logits of std sqrt(emb_dim) at init.
    tied_scale = 1.0 if (c.normalize_embedding_logits or not c.logits_via_embedding) else c.emb_dim**-0.5
    self.embed = Embed(c.vocab_size, c.emb_dim, init_std=tied_scale, dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=rngs)
    n_dense = c.first_num_dense_layers
    if c.scan_layers:
      self.dense_layers = stacked_layers(s.dense_layer, policy, jax.random.split(rngs.params(), n_dense), DENSE_LAYERS_AXIS) if n_dense else None
      self.layers, self.layers_outside_pipeline = main_stacks(c, s.layer, policy, rngs)
    else:
      self.dense_layers = nnx.List([DecoderLayer(s.dense_layer, policy=policy, rngs=rngs) for _ in range(n_dense)]) if n_dense else None
      self.layers = nnx.List([DecoderLayer(s.layer, policy=policy, rngs=rngs) for _ in range(c.num_decoder_layers - n_dense)])
      self.layers_outside_pipeline = None  # no pipeline without scanned layers
    self.final_norm = RMSNorm.of(c.emb_dim, s.norm, policy.dtypes)
    # The output kernel stays in weight_dtype; quantize_logits_proj quantizes its product (output_head).
    self.output = None if c.logits_via_embedding else DenseGeneral((c.emb_dim,), (c.vocab_size,), ("embed", "vocab"), **{**kw, "quant": None})
    mtp_policy = dataclasses.replace(policy, quantization=None)  # MaxText's quantize_mtp=false: the MTP modules stay unquantized
    self.mtp = nnx.List([MTPBlock(s.layer, c.remat_policy, policy=mtp_policy, rngs=rngs) for _ in range(c.mtp_num_layers)]) if c.mtp_num_layers else None

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings as the first layer sees them (scaled by sqrt(emb_dim) for Gemma)."""
    x = self.embed(tokens)
    if self.family.scale_embedding:
      x = x * jnp.asarray(math.sqrt(self.config.emb_dim), x.dtype)
    return x

  def input_stream(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, S] -> the residual stream state entering the first layer ([B, S, E], or [B, S, n, E] with mHC)."""
    x = constrain(self.embed_tokens(tokens), ("activation_batch", "activation_length", "activation_embed"), self.config.logical_axis_rules)
    return expand_streams(x, self.specs.residual)

  def hidden_states(
    self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """tokens [B, S] -> (final-normed hidden [B, S, E], weighted MoE load-balance loss)."""
    hidden, _, stats = self.forward_hidden(tokens, positions, segment_ids, adapter_ids)
    return hidden, stats["lb_loss"]

  def _run_layers(
    self, layers: nnx.Module, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, windows: list[int], adapter_ids: jax.Array | None = None
  ):
    """A stack (scanned) or list of layers over x -> (x, per-layer MoE statistics stacked on a leading axis).

    Scanned layers take their window as a scan input when windows differ (gemma2, gemma3, gpt_oss): attention then
    switches between one kernel per window (attention_ops.attend). Scanning over groups of the windows' period
    instead (decoding does, for its per-layer caches) measured far more TPU memory in training: XLA copied each
    group position's slice of every stacked weight out of the loop (benchmarks/README.md).
    """
    c = self.config

    offload = self.policy.offload_layer_inputs

    def layer_fn(graphdef: nnx.GraphDef, layer_state: Any, h: jax.Array, window: int | jax.Array):
      h = checkpoint_name(h, remat.LAYER_INPUT)  # before any other use of h, so an offloaded input is the only copy kept
      layer = nnx.merge(graphdef, tied_to_carry(layer_state, h, self.policy.dtypes.compute) if c.scan_layers else layer_state)
      return layer(h, positions, segment_ids, window, adapter_ids=adapter_ids)

    if c.scan_layers:
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

  def forward_hidden(
    self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """tokens [B, S] -> (final-normed hidden [B, S, E], hidden before the final norm, MoE statistics).

    Statistics: lb_loss (load-balance loss x load_balance_loss_weight / num_decoder_layers, summed over layers),
    dropped (routed pairs dropped over capacity, summed over layers), load [MoE layers, num_experts].
    adapter_ids [B] or [B, S]: the LoRA slot of each row or token when lora.max_lora_adapters > 1 (None: slot 0).
    """
    c = self.config
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = self.input_stream(tokens)
    windows = self.family.layer_windows(c)
    n_dense = c.first_num_dense_layers
    lb = jnp.zeros((), jnp.float32)
    if self.dense_layers is not None:
      x, dense_stats = self._run_layers(self.dense_layers, x, positions, segment_ids, windows[:n_dense], adapter_ids)
      lb = lb + jnp.sum(dense_stats["lb_loss"])
    schedule = self.specs.pipeline
    if schedule is None:
      x, stats = self._run_layers(self.layers, x, positions, segment_ids, windows[n_dense:], adapter_ids)
    else:
      piped = n_dense + schedule.plan.layers
      x, stats = schedule(self.layers, x, positions, segment_ids, adapter_ids, windows[n_dense:piped], self.policy)
      if self.layers_outside_pipeline is not None:
        x, after = self._run_layers(self.layers_outside_pipeline, x, positions, segment_ids, windows[piped:], adapter_ids)
        stats = {k: jnp.concatenate([stats[k], after[k]]) for k in ("lb_loss", "dropped", "load")}
    x = collapse_streams(x, self.specs.residual)
    hidden = self.final_norm(x)
    lb = (lb + jnp.sum(stats["lb_loss"])) * (c.load_balance_loss_weight / c.num_decoder_layers)
    return hidden, x, {"lb_loss": lb, "dropped": jnp.sum(stats["dropped"]), "load": stats["load"]}

  def output_head(self) -> OutputHead:
    """The map from final hidden states to logits: the output kernel, or the embedding table when tied."""
    c = self.config
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
      c.final_logits_soft_cap or 0.0,
      c.logical_axis_rules,
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
