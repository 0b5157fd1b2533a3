"""One decoder layer, shared by every family: attention and MLP/MoE branches around residual connections."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.layers import lora
from maxtext.layers.attention import Attention, AttentionSpec
from maxtext.layers.compressed_attention import CompressedAttention, CompressedAttentionSpec
from maxtext.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec, GatedDeltaNetState
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.lora import LoRASpec
from maxtext.layers.mla import MLA, MLASpec
from maxtext.layers.mla_sparse import SparseMLA, SparseMLASpec
from maxtext.layers.mlp import MLP, MLPSpec, activation
from maxtext.layers.moe import MoE, MoESpec, empty_stats
from maxtext.layers.norms import NormSpec, RMSNorm
from maxtext.layers.residual import ResidualSpec, make_connection
from maxtext.layers.sharding import Rules, constrain
from maxtext.platform import Policy

if TYPE_CHECKING:
  from maxtext.inference.kv_cache import LayerCache


MODULES: dict[type, type[nnx.Module]] = {
  AttentionSpec: Attention,
  CompressedAttentionSpec: CompressedAttention,
  MLASpec: MLA,
  SparseMLASpec: SparseMLA,
  GatedDeltaNetSpec: GatedDeltaNet,
  MLPSpec: MLP,
  MoESpec: MoE,
}  # spec type -> its layer module


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """One decoder layer (maxtext.models.specs builds it)."""

  emb_dim: int
  attention: Any  # the token mixer's spec: AttentionSpec (grouped-query), MLASpec (multi-head latent), GatedDeltaNetSpec, ... (MODULES)
  feed_forward: Any  # the feed-forward's spec: MLPSpec (dense) or MoESpec (experts)
  norm: NormSpec  # the branch norms
  residual: ResidualSpec  # the plain residual or mHC
  post_norms: bool = False  # an RMSNorm on each branch output too (Gemma 2 and 3)
  pre_norms: bool = True  # an RMSNorm on each branch input (OLMo 3: none, post_norms only)
  lora: LoRASpec | None = None  # adapters on the layer's projections (lora.enable_lora)
  num_experts: int = 1  # the statistics' width (a dense layer in a model with experts reports zeros for each)
  rules: Rules = ()  # logical_axis_rules
  per_layer_input: int = 0  # width of the per-layer input gated in after the MLP branch (Gemma 4's hidden_size_per_layer_input); 0: none
  layer_scalar: bool = False  # the layer's output is multiplied by a learned scalar (Gemma 4)


class DecoderLayer(nnx.Module):
  def __init__(self, spec: LayerSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec

    def norm() -> RMSNorm:
      return RMSNorm.of(spec.emb_dim, spec.norm, policy.dtypes)

    self.pre_attention_norm = norm() if spec.pre_norms else None
    self.attention = MODULES[type(spec.attention)](spec.attention, policy=policy, rngs=rngs)
    self.post_attention_norm = norm() if spec.post_norms else None
    self.pre_mlp_norm = norm() if spec.pre_norms else None
    self.mlp = MODULES[type(spec.feed_forward)](spec.feed_forward, policy=policy, rngs=rngs)
    self.post_mlp_norm = norm() if spec.post_norms else None
    self.attention_connection = make_connection(spec.residual, policy.dtypes)
    self.mlp_connection = make_connection(spec.residual, policy.dtypes)
    if spec.per_layer_input:  # Gemma 4: x += norm(W_p (act(W_g x) * per_layer_input))
      kw = dense_kwargs(policy, rngs)
      self.per_layer_input_gate = DenseGeneral((spec.emb_dim,), (spec.per_layer_input,), ("embed", "mlp"), **kw)
      self.per_layer_projection = DenseGeneral((spec.per_layer_input,), (spec.emb_dim,), ("mlp", "embed"), **kw)
      self.post_per_layer_input_norm = norm()
    else:
      self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
    self.layer_scalar = nnx.Param(jnp.ones((), policy.dtypes.params), logical_axes=()) if spec.layer_scalar else None
    lora.attach(self, spec.lora, policy.dtypes, rngs)  # adapters last, so base parameters draw the same random keys with or without LoRA

  def branches(self) -> tuple[tuple[nnx.Module, RMSNorm | None, nnx.Module, RMSNorm | None], ...]:
    """The layer's data flow, bottom to top: the attention branch, then the MLP (or MoE) branch, each as (its
    residual connection, pre-norm or None, body, post-norm or None). maxtext.counting reads it."""
    return (
      (self.attention_connection, self.pre_attention_norm, self.attention, self.post_attention_norm),
      (self.mlp_connection, self.pre_mlp_norm, self.mlp, self.post_mlp_norm),
    )

  def _linear_mixer(self, h: jax.Array, segment_ids: jax.Array | None, state: Any, adapter_ids: jax.Array | None):
    """The Gated DeltaNet mixer: the chunked form in training; with a decode cache (a LayerCache holding the layer's
    'conv' window and 'recurrent' state), a prefill (chunked) or a decode step (recurrent) continuing it -> (y, cache)."""
    if state is None:
      return self.attention(h, segment_ids, adapter_ids)
    real = (jnp.arange(h.shape[1])[None, :] < state.new_lengths[:, None]).astype(jnp.int32)  # right padding: segment 0
    previous = GatedDeltaNetState(state.arrays["conv"], state.arrays["recurrent"])
    y, new = self.attention.mix(h, real, previous, recurrent=h.shape[1] == 1, adapter_ids=adapter_ids)
    arrays = {"conv": new.conv.astype(previous.conv.dtype), "recurrent": new.recurrent.astype(previous.recurrent.dtype)}
    return y, dataclasses.replace(state, arrays=arrays)

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    window: int | jax.Array,
    cache: LayerCache | None = None,
    adapter_ids: jax.Array | None = None,
    image_ids: jax.Array | None = None,
    per_layer_input: jax.Array | None = None,
    shared_kv: tuple[jax.Array, jax.Array] | None = None,
    return_kv: bool = False,
    rope_positions: jax.Array | None = None,
    token_ids: jax.Array | None = None,
  ) -> tuple:
    """x: residual stream state -> (new state, MoE statistics of this layer: lb_loss, dropped, load; zeros if dense;
    indexer_loss: a sparse MLA's weighted indexer KL summed over its query tokens, else 0);
    with a KV cache (decoding), (..., updated cache). adapter_ids [B] or [B, S]: each row's (or token's) LoRA slot
    when the layer holds several adapters (None: slot 0). per_layer_input [B, S, P]: this layer's per-layer input
    (Gemma 4). shared_kv: the keys and values a KV-shared layer attends with; return_kv: (..., (keys, values)) of
    this layer, for the layers that share them. image_ids [B, S]: each token's image, 0 for text (Gemma 3's images
    attend within themselves both ways). rope_positions [B, S, 3]: Qwen3-VL's multimodal rope positions (use_mrope).
    token_ids [B, S]: the input tokens, which pick a hash-routed MoE's experts (DeepSeek V4)."""
    rot = {} if rope_positions is None else {"rope_positions": rope_positions}
    aux = {**empty_stats(self.spec.num_experts), "indexer_loss": jnp.zeros((), jnp.float32)}
    kv = None

    def attention_branch(h: jax.Array) -> jax.Array:
      nonlocal cache, kv
      if self.pre_attention_norm is not None:
        h = self.pre_attention_norm(h)
      if isinstance(self.attention, CompressedAttention):  # DeepSeek V4: its window and compression are in its spec
        if cache is None:
          y = self.attention(h, positions)
        else:
          y, cache = self.attention.extend(h, positions, cache)
      elif isinstance(self.attention, GatedDeltaNet):  # a linear mixer: no positions or window; its decode state is its cache
        y = self._linear_mixer(h, segment_ids, cache, adapter_ids)
        if cache is not None:
          y, cache = y
      elif cache is None and isinstance(self.attention, SparseMLA):  # its output and its weighted indexer KL (summed over tokens)
        y, aux["indexer_loss"] = self.attention(h, positions, segment_ids, window, adapter_ids=adapter_ids)
      elif shared_kv is not None or return_kv:
        images = {} if image_ids is None or cache is not None else {"image_ids": image_ids}
        y = self.attention(h, positions, segment_ids, window, cache=cache, adapter_ids=adapter_ids, shared_kv=shared_kv, return_kv=return_kv, **images, **rot)
        if return_kv:
          *y, kv = y
        if cache is not None:
          y, cache = y
        elif return_kv:
          (y,) = y
      elif cache is None:
        images = {} if image_ids is None else {"image_ids": image_ids}
        y = self.attention(h, positions, segment_ids, window, adapter_ids=adapter_ids, **images, **rot)
      else:
        y, cache = self.attention(h, positions, segment_ids, window, cache=cache, adapter_ids=adapter_ids, **rot)
      return self.post_attention_norm(y) if self.post_attention_norm is not None else y

    def mlp_branch(h: jax.Array) -> jax.Array:
      nonlocal aux
      unnormed = h
      h = self.pre_mlp_norm(h) if self.pre_mlp_norm is not None else h
      if isinstance(self.mlp, MoE):
        valid = segment_ids != 0 if segment_ids is not None else jnp.ones(h.shape[:2], bool)
        y, stats = self.mlp(h, valid, adapter_ids, unnormed=unnormed, token_ids=token_ids)
        aux = {**stats, "indexer_loss": aux["indexer_loss"]}
      else:
        y = self.mlp(h, adapter_ids)
      return self.post_mlp_norm(y) if self.post_mlp_norm is not None else y

    x = self.attention_connection(x, attention_branch)
    x = self.mlp_connection(x, mlp_branch)
    if self.per_layer_input_gate is not None:
      gated = activation(self.spec.feed_forward.activations[0])(self.per_layer_input_gate(x)) * per_layer_input.astype(x.dtype)
      x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
    if self.layer_scalar is not None:
      x = x * self.layer_scalar[...].astype(x.dtype)
    x = constrain(x, ("activation_batch", "activation_length") + (None,) * (x.ndim - 3) + ("activation_embed",), self.spec.rules)
    out = (x, aux) if cache is None else (x, aux, cache)
    return out + (kv,) if return_kv else out
