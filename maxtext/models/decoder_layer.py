"""One decoder layer, shared by every family: attention and MLP/MoE branches around residual connections."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.config import MaxTextConfig
from maxtext.layers import lora
from maxtext.layers.attention import Attention
from maxtext.layers.dtypes import dtype
from maxtext.layers.mla import MLA
from maxtext.layers.mlp import MLP
from maxtext.layers.moe import MoE, empty_stats
from maxtext.layers.norms import RMSNorm
from maxtext.layers.residual import make_connection
from maxtext.layers.sharding import constrain
from maxtext.models.family import Family
from maxtext.platform import Policy

if TYPE_CHECKING:
  from maxtext.inference.kv_cache import LayerCache


class DecoderLayer(nnx.Module):
  """dense=True forces a dense MLP (DeepSeek's first_num_dense_layers) in a model with experts."""

  def __init__(self, config: MaxTextConfig, family: Family, *, policy: Policy, rngs: nnx.Rngs, dense: bool = False):
    c = config
    self.config = c
    zc = family.zero_centered_norms

    def norm() -> RMSNorm:
      return RMSNorm(c.emb_dim, c.normalization_layer_epsilon, dtype=dtype(c.dtype), weight_dtype=dtype(c.weight_dtype), zero_centered=zc)

    self.pre_attention_norm = norm()
    self.attention = (
      MLA(c, policy=policy, rngs=rngs) if family.mla else Attention(c, policy=policy, rngs=rngs, zero_centered_norm=zc, window_choices=family.layer_windows(c))
    )
    self.post_attention_norm = norm() if family.post_norms else None
    self.pre_mlp_norm = norm()
    self.mlp = MoE(c, policy=policy, rngs=rngs) if c.num_experts > 1 and not dense else MLP(c, policy=policy, rngs=rngs)
    self.post_mlp_norm = norm() if family.post_norms else None
    self.attention_connection = make_connection(c, rngs=rngs)
    self.mlp_connection = make_connection(c, rngs=rngs)
    lora.attach(self, c, rngs)  # adapters last, so base parameters draw the same random keys with or without LoRA

  def branches(self) -> tuple[tuple[nnx.Module, RMSNorm, nnx.Module, RMSNorm | None], ...]:
    """The layer's data flow, bottom to top: the attention branch, then the MLP (or MoE) branch, each as (its
    residual connection, pre-norm, body, post-norm or None). maxtext.models.counting reads it."""
    return (
      (self.attention_connection, self.pre_attention_norm, self.attention, self.post_attention_norm),
      (self.mlp_connection, self.pre_mlp_norm, self.mlp, self.post_mlp_norm),
    )

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, window: int | jax.Array, cache: LayerCache | None = None) -> tuple:
    """x: residual stream state -> (new state, MoE statistics of this layer: lb_loss, dropped, load; zeros if dense);
    with a KV cache (decoding), (..., updated cache)."""
    aux = empty_stats(self.config.num_experts)

    def attention_branch(h: jax.Array) -> jax.Array:
      nonlocal cache
      if cache is None:
        y = self.attention(self.pre_attention_norm(h), positions, segment_ids, window)
      else:
        y, cache = self.attention(self.pre_attention_norm(h), positions, segment_ids, window, cache=cache)
      return self.post_attention_norm(y) if self.post_attention_norm is not None else y

    def mlp_branch(h: jax.Array) -> jax.Array:
      nonlocal aux
      h = self.pre_mlp_norm(h)
      if isinstance(self.mlp, MoE):
        valid = segment_ids != 0 if segment_ids is not None else jnp.ones(h.shape[:2], bool)
        y, aux = self.mlp(h, valid)
      else:
        y = self.mlp(h)
      return self.post_mlp_norm(y) if self.post_mlp_norm is not None else y

    x = self.attention_connection(x, attention_branch)
    x = self.mlp_connection(x, mlp_branch)
    x = constrain(x, ("activation_batch", "activation_length") + (None,) * (x.ndim - 3) + ("activation_embed",), self.config.logical_axis_rules)
    return (x, aux) if cache is None else (x, aux, cache)
