"""The decoder-only Transformer: embedding, stacked (scanned) or looped layers, final norm, logits."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.errors import ConfigError
from maxtext.layers import context_parallel
from maxtext.layers.embed import Embed
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.output_head import OutputHead
from maxtext.layers.residual import collapse_streams, expand_streams, make_head
from maxtext.layers.sharding import constrain
from maxtext.models import block_scan, layer_pattern, remat
from maxtext.models.decoder_layer import DecoderLayer
from maxtext.models.layer_stacks import block_stacks, main_stacks, stacked_layers
from maxtext.models.mtp import MTPBlock
from maxtext.models.remat import tied_to_carry
from maxtext.models.specs import DecoderSpec
from maxtext.platform import Policy
from maxtext.vision import gemma3_encoder, llama4_vision, qwen3_vl_encoder


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
    if c.hidden_size_per_layer_input:  # Gemma 4's per-layer inputs
      n, p = c.num_decoder_layers, c.hidden_size_per_layer_input
      vocab = c.vocab_size_per_layer_input or c.vocab_size
      self.per_layer_inputs_embed = Embed(vocab, n * p, dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=rngs)
      self.per_layer_model_projection = DenseGeneral((c.emb_dim,), (n * p,), ("embed", "mlp"), **{**kw, "quant": None})
      self.per_layer_projection_norm = RMSNorm.of(p, s.norm, policy.dtypes)
    else:
      self.per_layer_inputs_embed = self.per_layer_model_projection = self.per_layer_projection_norm = None
    self.stacks = layer_pattern.stacks(s.kinds)  # the pattern's layer stacks (dense_layers, layers), bottom to top
    built: dict[str, Any] = {}
    for stack in self.stacks:
      stack_specs = s.layers[stack.start : stack.start + len(stack.kinds)]
      if not c.scan_layers or (stack.period > 1 and stack.name != layer_pattern.MAIN_STACK):  # a prefix of several structures: unscanned
        built[stack.name] = nnx.List([DecoderLayer(spec, policy=policy, rngs=rngs) for spec in stack_specs])
      elif stack.period > 1:
        plan = s.pipeline.plan if stack.name == layer_pattern.MAIN_STACK and s.pipeline is not None else None  # units: whole groups
        built[stack.name], built[layer_pattern.REMAINDER] = block_stacks(stack, stack_specs, policy, rngs, plan)
      elif stack.name == layer_pattern.MAIN_STACK:
        built[stack.name], built["layers_outside_pipeline"] = main_stacks(s.pipeline and s.pipeline.plan, stack_specs[0], policy, rngs, len(stack.kinds))
      else:
        built[stack.name] = stacked_layers(stack_specs[0], policy, jax.random.split(rngs.params(), len(stack.kinds)), stack.name)
    self.dense_layers = built.get(layer_pattern.PREFIX_STACK)
    self.layers = built[layer_pattern.MAIN_STACK]
    self.layers_outside_pipeline = built.get("layers_outside_pipeline")  # no pipeline without scanned layers
    self.layers_remainder = built.get(layer_pattern.REMAINDER)  # a block stack's layers after its last whole group (a prefix has one structure)
    self.hashed = any(k.ffn == "moe_hash" for k in s.kinds)  # hash-routed layers read the token ids (DeepSeek V4)
    self.hyper_head = make_head(s.residual, policy.dtypes)  # DeepSeek V4's learned collapse of the mHC streams, or None
    self.final_norm = RMSNorm.of(c.emb_dim, s.norm, policy.dtypes)
    # The output kernel stays in weight_dtype; quantize_logits_proj quantizes its product (output_head).
    self.output = None if c.logits_via_embedding else DenseGeneral((c.emb_dim,), (c.vocab_size,), ("embed", "vocab"), **{**kw, "quant": None})
    mtp_policy = dataclasses.replace(policy, quantization=None)  # MaxText's quantize_mtp=false: the MTP modules stay unquantized
    self.mtp = nnx.List([MTPBlock(s.layer, c.remat_policy, policy=mtp_policy, rngs=rngs) for _ in range(c.mtp_num_layers)]) if c.mtp_num_layers else None
    self.vision = vision_encoder(s.vision, policy, rngs)  # use_multimodal

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings as the first layer sees them (scaled by sqrt(emb_dim) for Gemma)."""
    x = self.embed(tokens)
    if self.spec.scale_embedding:
      x = x * jnp.asarray(math.sqrt(self.spec.emb_dim), x.dtype)
    return x

  def per_layer_inputs(self, tokens: jax.Array) -> jax.Array | None:
    """tokens [B, S] -> each layer's per-layer input [layers, B, S, P] (Gemma 4), or None: (the layers' rows of the
    per-layer table x sqrt(P) + RMSNorm(the embeddings projected, / sqrt(emb_dim))) / sqrt(2)."""
    if self.per_layer_inputs_embed is None:
      return None
    c = self.spec
    n, p = c.num_decoder_layers, c.hidden_size_per_layer_input
    table = self.per_layer_inputs_embed(tokens)
    token_part = (table * jnp.asarray(math.sqrt(p), table.dtype)).reshape(*tokens.shape, n, p)
    projected = self.per_layer_model_projection(self.embed_tokens(tokens)) * jnp.asarray(c.emb_dim**-0.5, table.dtype)
    context_part = self.per_layer_projection_norm(projected.reshape(*tokens.shape, n, p))
    combined = (context_part + token_part) * jnp.asarray(2.0**-0.5, table.dtype)
    return jnp.moveaxis(combined, 2, 0)

  def input_stream(self, tokens: jax.Array, images: Any = None) -> jax.Array:
    """tokens [B, S] -> the residual stream state entering the first layer ([B, S, E], or [B, S, n, E] with mHC).
    images [B, M, S_img, S_img, 3] (use_multimodal): each row's images, whose soft tokens replace its placeholders;
    Qwen3-VL takes a qwen3_vl_encoder.Qwen3VLImages (see multimodal_inputs)."""
    return self.multimodal_inputs(tokens, images)[0]

  def multimodal_inputs(self, tokens: jax.Array, images: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """-> (input_stream's state, what the layers also take: Qwen3-VL's rope_positions [B, S, 3] and its placed
    DeepStack features `deepstack` [n, B, S, E], added after the first n layers; empty otherwise)."""
    extras: dict[str, jax.Array] = {}
    if images is None:
      x = self.embed_tokens(tokens)
    else:
      if self.vision is None:
        raise ConfigError(f"images were given to a text-only model (decoder_block={self.spec.decoder_block}, use_multimodal=false); give token ids alone")
      placeholder = self.vision.spec.image_token_id
      text = self.embed_tokens(jnp.where(tokens == placeholder, 0, tokens))  # the placeholder may lie past the vocabulary
      if isinstance(self.vision, qwen3_vl_encoder.Qwen3VLVisionEncoder):
        x, extras["deepstack"] = self.vision.embed(text, tokens, images)
        extras["rope_positions"] = jnp.asarray(images.rope_positions)
      else:
        x = gemma3_encoder.merge(text, self.vision(images), tokens, placeholder)
    x = constrain(x, ("activation_batch", "activation_length", "activation_embed"), self.spec.rules)
    return expand_streams(x, self.specs.residual), extras

  def image_ids(self, tokens: jax.Array, images: Any) -> jax.Array | None:
    """Each token's image (1, 2, ... per row; 0 for text) when images are given to Gemma 3 (whose image tokens see
    each other both ways), else None (Qwen3-VL's image tokens stay causal)."""
    if images is None or not isinstance(self.vision, gemma3_encoder.Gemma3VisionEncoder):
      return None
    return gemma3_encoder.image_ids(tokens, self.vision.spec.image_token_id)

  def hidden_states(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    adapter_ids: jax.Array | None = None,
    images: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """tokens [B, S] -> (final-normed hidden [B, S, E], weighted MoE load-balance loss)."""
    hidden, _, stats = self.forward_hidden(tokens, positions, segment_ids, adapter_ids, images)
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
    image_ids: jax.Array | None = None,
    per_layer: jax.Array | None = None,
    kinds: tuple | None = None,
    extras: dict[str, jax.Array] | None = None,
    start: int = 0,
    token_ids: jax.Array | None = None,
  ):
    """A stack (scanned; stacked defaults to scan_layers) or list of layers over x -> (x, per-layer MoE statistics
    stacked on a leading axis).

    Scanned layers take their window as a scan input when windows differ (gemma2, gemma3, gpt_oss): attention then
    switches between one kernel per window (attention_ops.attend). Scanning over groups of the windows' period
    instead (decoding does, for its per-layer caches) measured far more TPU memory in training: XLA copied each
    group position's slice of every stacked weight out of the loop (benchmarks/README.md).
    extras: multimodal_inputs' (Qwen3-VL); its DeepStack features are added after the model's layers 0, 1, ...
    (the stack's layer i is model layer start + i). token_ids: the tokens, for hash-routed layers (or None).
    """
    c = self.spec
    stacked = c.scan_layers if stacked is None else stacked
    offload = self.policy.offload_layer_inputs
    extras = extras or {}
    images = {} if image_ids is None else {"image_ids": image_ids}
    if "rope_positions" in extras:
      images["rope_positions"] = extras["rope_positions"]
    if token_ids is not None:
      images["token_ids"] = token_ids
    deep = extras.get("deepstack")

    def layer_fn(graphdef: nnx.GraphDef, layer_state: Any, h: jax.Array, window: int | jax.Array, extra: dict, return_kv: bool = False):
      h = checkpoint_name(h, remat.LAYER_INPUT)  # before any other use of h, so an offloaded input is the only copy kept
      layer = nnx.merge(graphdef, tied_to_carry(layer_state, h, self.policy.dtypes.compute) if stacked else layer_state)
      return layer(h, positions, segment_ids, window, adapter_ids=adapter_ids, return_kv=return_kv, **images, **extra)

    if stacked:
      graphdef, state = nnx.split(layers)
      static_window = windows[0] if len(set(windows)) == 1 else None

      def body(h, xs):
        layer_state, window, ple, index = xs
        extra = {} if ple is None else {"per_layer_input": ple}
        out = layer_fn(graphdef, layer_state, h, static_window if static_window is not None else window, extra)
        if deep is None:
          return out
        return (qwen3_vl_encoder.deepstack_add(out[0], index, deep), *out[1:])

      body = remat.wrap(body, c.remat_policy, prevent_cse=False, offload_input=offload)
      indices = jnp.arange(start, start + len(windows), dtype=jnp.int32)
      return jax.lax.scan(body, x, (state, jnp.asarray(windows, jnp.int32), per_layer, indices))
    stats_per_layer, shared = [], {}  # shared: window -> the keys and values of the last unshared layer with it (KV sharing)
    for i, (layer, window) in enumerate(zip(layers, windows)):
      graphdef, state = nnx.split(layer)
      kind = kinds[i] if kinds is not None else None
      extra = {} if per_layer is None else {"per_layer_input": per_layer[i]}
      if kind is not None and kind.kv_shared:
        extra["shared_kv"] = shared[window]
      emit = kind is not None and not kind.kv_shared and any(k.kv_shared for k in kinds)
      step = remat.wrap(lambda h, st, ex, w=window, g=graphdef, e=emit: layer_fn(g, st, h, w, ex, e), c.remat_policy, prevent_cse=True, offload_input=offload)
      out = step(x, state, extra)
      x, stats = out[0], out[1]
      if deep is not None:
        x = qwen3_vl_encoder.deepstack_add(x, start + i, deep)
      if emit:
        shared[window] = out[2]
      stats_per_layer.append(stats)
    return x, jax.tree.map(lambda *xs: jnp.stack(xs), *stats_per_layer)

  def _run_stack(
    self,
    stack: layer_pattern.Stack,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    adapter_ids: jax.Array | None,
    image_ids: jax.Array | None = None,
    per_layer: jax.Array | None = None,
    extras: dict[str, jax.Array] | None = None,
    token_ids: jax.Array | None = None,
  ):
    """One of the pattern's stacks over x -> (x, per-layer MoE statistics, bottom to top). per_layer: every model
    layer's per-layer input [layers, B, S, P] (Gemma 4) or None. extras: multimodal_inputs' (Qwen3-VL)."""
    layers = getattr(self, stack.name)
    mine = None if per_layer is None else per_layer[stack.start : stack.start + len(stack.kinds)]
    listed = stack.period > 1 and stack.name != layer_pattern.MAIN_STACK  # a prefix of several structures runs unscanned
    if not self.spec.scan_layers or stack.period == 1 or listed:
      return self._run_layers(
        layers,
        x,
        positions,
        segment_ids,
        list(stack.windows),
        adapter_ids,
        stacked=self.spec.scan_layers and not listed,
        per_layer=mine,
        kinds=stack.kinds,
        image_ids=image_ids,
        extras=extras,
        start=stack.start,
        token_ids=token_ids,
      )
    if extras:
      raise ConfigError(
        f"decoder_block={self.spec.decoder_block} repeats a block of different layers, which Qwen3-VL's images do not run through; use qwen3 or qwen3_moe"
      )
    whole = stack.num_groups * stack.period
    x, stats = block_scan.run_block(
      stack,
      layers,
      x,
      positions,
      segment_ids,
      adapter_ids,
      remat_policy=self.spec.remat_policy,
      policy=self.policy,
      image_ids=image_ids,
      per_layer=None if mine is None else mine[:whole],
      token_ids=token_ids,
    )
    rest = self.layers_remainder
    if rest is None:
      return x, stats
    x, after = self._run_layers(
      rest,
      x,
      positions,
      segment_ids,
      [k.span for k in stack.remainder],
      adapter_ids,
      stacked=False,
      per_layer=None if mine is None else mine[whole:],
      image_ids=image_ids,
      token_ids=token_ids,
    )
    return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, after)

  def forward_hidden(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    adapter_ids: jax.Array | None = None,
    images: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """tokens [B, S] -> (final-normed hidden [B, S, E], hidden before the final norm, MoE statistics).

    Statistics: lb_loss (load-balance loss x load_balance_loss_weight / num_decoder_layers, summed over layers),
    indexer_loss (DeepSeek Sparse Attention: the indexer KL x indexer_loss_scaling_factor summed over query tokens,
    averaged over layers),
    dropped (routed pairs dropped over capacity, summed over layers), load [MoE layers, num_experts].
    adapter_ids [B] or [B, S]: the LoRA slot of each row or token when lora.max_lora_adapters > 1 (None: slot 0).
    images [B, M, S_img, S_img, 3] (use_multimodal): each row's images in placeholder order (see input_stream).
    """
    c = self.spec
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, extras = self.multimodal_inputs(tokens, images)
    image_ids = self.image_ids(tokens, images)
    per_layer = self.per_layer_inputs(tokens)
    *prefix, main = self.stacks
    windows = list(main.windows)
    lb = indexer = jnp.zeros((), jnp.float32)
    token_ids = tokens if self.hashed else None
    prefix_dropped, prefix_loads = 0, []  # the load of a prefix with experts (DeepSeek V4's hash-routed layers; DeepSeek V3's are dense)
    for stack in prefix:
      x, dense_stats = self._run_stack(
        stack, x, positions, segment_ids, adapter_ids, image_ids=image_ids, per_layer=per_layer, extras=extras, token_ids=token_ids
      )
      lb = lb + jnp.sum(dense_stats["lb_loss"])
      indexer = indexer + jnp.sum(dense_stats["indexer_loss"])
      if any(k.ffn != "dense" for k in stack.kinds):
        prefix_loads.append(dense_stats["load"])
        prefix_dropped = prefix_dropped + jnp.sum(dense_stats["dropped"])
    schedule = self.specs.pipeline
    if schedule is None:
      x, stats = self._run_stack(main, x, positions, segment_ids, adapter_ids, image_ids=image_ids, per_layer=per_layer, extras=extras, token_ids=token_ids)
    else:
      piped = schedule.plan.layers * schedule.plan.period
      x, stats = schedule(self.layers, x, positions, segment_ids, adapter_ids, windows[:piped], self.policy)
      if self.layers_remainder is not None:  # a hybrid stack's layers after its last whole block
        x, after = self._run_layers(self.layers_remainder, x, positions, segment_ids, windows[piped:], adapter_ids, stacked=False)
        stats = {k: jnp.concatenate([stats[k], after[k]]) for k in ("lb_loss", "dropped", "load", "indexer_loss")}
      if self.layers_outside_pipeline is not None:
        x, after = self._run_layers(self.layers_outside_pipeline, x, positions, segment_ids, windows[piped:], adapter_ids)
        stats = {k: jnp.concatenate([stats[k], after[k]]) for k in ("lb_loss", "dropped", "load", "indexer_loss")}
    x = self.hyper_head(x) if self.hyper_head is not None else collapse_streams(x, self.specs.residual)
    hidden = self.final_norm(x)
    lb = (lb + jnp.sum(stats["lb_loss"])) * (c.load_balance_loss_weight / c.num_decoder_layers)
    indexer = (indexer + jnp.sum(stats["indexer_loss"])) / c.num_decoder_layers
    load = jnp.concatenate([*prefix_loads, stats["load"]]) if prefix_loads else stats["load"]
    return hidden, x, {"lb_loss": lb, "dropped": prefix_dropped + jnp.sum(stats["dropped"]), "load": load, "indexer_loss": indexer}

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
      tied=self.output is None,
    )

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Final hidden states [..., E] -> float32 logits [..., vocab]."""
    return self.output_head().logits(hidden)

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    adapter_ids: jax.Array | None = None,
    images: jax.Array | None = None,
  ) -> jax.Array:
    """tokens [B, S] -> logits [B, S, vocab], in the sequence layout context parallelism's wrapper gives
    (context_parallel.in_shard_order: the shards' order inside, natural order out). images: see forward_hidden
    (a multimodal model runs without context parallelism)."""
    if images is not None:
      return self._logits(tokens, positions, segment_ids, adapter_ids, images)
    return context_parallel.in_shard_order(self.specs.context, self._logits)(tokens, positions, segment_ids, adapter_ids)

  def _logits(
    self, tokens: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None, adapter_ids: jax.Array | None, images: jax.Array | None = None
  ) -> jax.Array:
    hidden, _ = self.hidden_states(tokens, positions, segment_ids, adapter_ids, images)
    return self.logits(hidden)


def vision_encoder(spec: Any, policy: Policy, rngs: nnx.Rngs) -> nnx.Module | None:
  """The image encoder its spec describes (Gemma 3's SigLIP and projector, Qwen3-VL's tower, or Llama 4's tile encoder
  and projector), or None without one."""
  if spec is None:
    return None
  if isinstance(spec, qwen3_vl_encoder.Qwen3VLEncoderSpec):
    return qwen3_vl_encoder.Qwen3VLVisionEncoder(spec, policy=policy, rngs=rngs)
  if isinstance(spec, llama4_vision.Llama4VisionSpec):
    return llama4_vision.Llama4VisionEncoder(spec, policy=policy, rngs=rngs)
  return gemma3_encoder.Gemma3VisionEncoder(spec, policy=policy, rngs=rngs)
