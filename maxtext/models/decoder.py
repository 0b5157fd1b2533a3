"""The decoder-only Transformer: embedding, stacked (scanned) or looped layers, final norm, logits."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.config import MaxTextConfig
from maxtext.layers import lora
from maxtext.layers.dtypes import dtype, precision
from maxtext.layers.embed import Embed
from maxtext.layers.linear import DenseGeneral
from maxtext.layers.norms import RMSNorm
from maxtext.layers.output_head import OutputHead
from maxtext.layers.residual import collapse_streams, expand_streams
from maxtext.layers.sharding import constrain
from maxtext.models import registry, remat
from maxtext.models.decoder_layer import DecoderLayer
from maxtext.platform import Policy

LAYERS_AXIS = "layers"


def _prepend_layers_axis(variable: nnx.Variable) -> nnx.Variable:
  axes = variable.get_metadata().get("logical_axes") or (None,) * (variable[...].ndim - 1)
  return variable.replace(logical_axes=(LAYERS_AXIS,) + tuple(axes))


def stacked_layers(config: MaxTextConfig, policy: Policy, rngs: nnx.Rngs) -> DecoderLayer:
  """One DecoderLayer whose parameters have a leading [num_decoder_layers] axis (logical name 'layers')."""
  family = registry.get(config.decoder_block)
  keys = jax.random.split(rngs.params(), config.num_decoder_layers)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLayer(config, family, policy=policy, rngs=nnx.Rngs(0))))
  state = jax.vmap(lambda k: nnx.state(DecoderLayer(config, family, policy=policy, rngs=nnx.Rngs(k))))(keys)
  state = jax.tree.map(_prepend_layers_axis, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.merge(graphdef, state)


class Transformer(nnx.Module):
  """Decoder-only LM. model(tokens) -> float32 logits [B, S, vocab]. policy: the target platform's kernels and numerics."""

  def __init__(self, config: MaxTextConfig, *, policy: Policy, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.policy = policy
    self.family = registry.get(c.decoder_block)
    kw = dict(dtype=dtype(c.dtype), weight_dtype=dtype(c.weight_dtype), precision=precision(c.matmul_precision), rngs=rngs)
    kw["integer_rounding"] = policy.integer_bf16_rounding
    # Tied tables also produce the logits: unit-variance rows would give logits of std sqrt(emb_dim) at init.
    tied_scale = 1.0 if (c.normalize_embedding_logits or not c.logits_via_embedding) else c.emb_dim**-0.5
    self.embed = Embed(c.vocab_size, c.emb_dim, init_std=tied_scale, dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=rngs)
    if c.scan_layers:
      self.layers = stacked_layers(c, policy, rngs)
    else:
      self.layers = nnx.List([DecoderLayer(c, self.family, policy=policy, rngs=rngs) for _ in range(c.num_decoder_layers)])
    self.final_norm = RMSNorm(
      c.emb_dim, c.normalization_layer_epsilon, dtype=dtype(c.dtype), weight_dtype=dtype(c.weight_dtype), zero_centered=self.family.zero_centered_norms
    )
    self.output = None if c.logits_via_embedding else DenseGeneral((c.emb_dim,), (c.vocab_size,), ("embed", "vocab"), **kw)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, S] -> the residual stream state entering the first layer ([B, S, E], or [B, S, n, E] with mHC)."""
    c = self.config
    x = self.embed(tokens)
    if self.family.scale_embedding:
      x = x * jnp.asarray(math.sqrt(c.emb_dim), x.dtype)
    x = constrain(x, ("activation_batch", "activation_length", "activation_embed"), c.logical_axis_rules)
    return expand_streams(x, c)

  def hidden_states(
    self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """tokens [B, S] -> (final-normed hidden [B, S, E], weighted MoE load-balance loss).

    adapter_ids [B]: the LoRA slot of each row when lora.max_lora_adapters > 1 (None: slot 0 for all).
    """
    with lora.adapter_rows(adapter_ids):
      return self._hidden_states(tokens, positions, segment_ids)

  def _hidden_states(self, tokens: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    c = self.config
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x = self.embed_tokens(tokens)
    windows = self.family.layer_windows(c)

    def layer_fn(layer: DecoderLayer, h: jax.Array, window: int | jax.Array) -> tuple[jax.Array, jax.Array]:
      return layer(checkpoint_name(h, "decoder_layer_input"), positions, segment_ids, window)

    if c.scan_layers:
      graphdef, state = nnx.split(self.layers)
      static_window = windows[0] if len(set(windows)) == 1 else None

      def body(h, xs):
        layer_state, window = xs
        return layer_fn(nnx.merge(graphdef, layer_state), h, static_window if static_window is not None else window)

      body = remat.wrap(body, c.remat_policy, prevent_cse=False)
      x, aux = jax.lax.scan(body, x, (state, jnp.asarray(windows, jnp.int32)))
      aux = jnp.sum(aux)
    else:
      aux = jnp.zeros((), jnp.float32)
      for layer, window in zip(self.layers, windows):
        graphdef, state = nnx.split(layer)
        step = remat.wrap(lambda h, st, w=window, g=graphdef: layer_fn(nnx.merge(g, st), h, w), c.remat_policy, prevent_cse=True)
        x, layer_aux = step(x, state)
        aux = aux + layer_aux
    x = collapse_streams(x, c)
    hidden = self.final_norm(x)
    return hidden, aux * (c.load_balance_loss_weight / c.num_decoder_layers)

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
      dtype(c.dtype),
      precision(c.matmul_precision),
      scale,
      c.final_logits_soft_cap or 0.0,
      c.logical_axis_rules,
      self.policy.integer_bf16_rounding,
    )

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Final hidden states [..., E] -> float32 logits [..., vocab]."""
    return self.output_head().logits(hidden)

  def __call__(
    self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None
  ) -> jax.Array:
    hidden, _ = self.hidden_states(tokens, positions, segment_ids, adapter_ids)
    return self.logits(hidden)
