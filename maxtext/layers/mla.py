"""Multi-head latent attention (DeepSeek V2/V3): low-rank query and key/value projections, decoupled rotary key.

Queries: x -> wq (q_lora_rank = 0), or x -> wq_a -> RMSNorm -> wq_b; each head is [nope | rope].
Keys and values: x -> wkv_a gives a kv_lora_rank latent (RMSNorm'd, then wkv_b expands it into per-head
key-nope and value parts) plus one qk_rope_head_dim rotary key shared by every head.
The attention itself runs on the same core as every other family (attention_ops.attention_mask/xla_attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.config import MaxTextConfig
from maxtext.layers import attention_ops, context_parallel, rope
from maxtext.layers.dtypes import dtype, precision
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.sharding import constrain
from maxtext.platform import Policy


def rope_frequencies(c: MaxTextConfig) -> tuple[np.ndarray, float]:
  """(inverse frequencies [qk_rope_head_dim // 2], cos/sin scale) of MLA's rotary part."""
  dim = c.qk_rope_head_dim
  if c.rope_type == "yarn":
    inv = rope.yarn_inverse_frequencies(dim, c.rope_max_timescale, c.rope_factor, c.original_max_position_embeddings, c.beta_fast, c.beta_slow, c.rope_truncate)
    return inv, rope.yarn_mscale(c.rope_factor) if c.rope_attention_scaling else 1.0
  inv = rope.inverse_frequencies(
    dim,
    c.rope_max_timescale,
    c.rope_type,
    c.rope_scaling_factor,
    c.rope_low_freq_factor,
    c.rope_high_freq_factor,
    c.rope_original_max_position_embeddings,
  )
  return inv, 1.0


def softmax_scale(c: MaxTextConfig) -> float:
  """1/sqrt(qk head dim), times YaRN's mscale^2 correction when rope_type is yarn and mscale > 0."""
  scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
  if c.rope_type == "yarn" and c.mscale > 0:
    scale *= rope.yarn_mscale(c.rope_factor, c.mscale) ** 2
  return scale


class MLA(nnx.Module):
  """Multi-head latent attention. The kernel comes from policy (maxtext.platform); fused kernels see values
  zero-padded to the query/key width, and the padding is cut from their output."""

  def __init__(self, config: MaxTextConfig, *, policy: Policy, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.policy = policy
    e, h = c.emb_dim, c.num_query_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    kw = dense_kwargs(c, policy, rngs)
    nkw = dict(dtype=dtype(c.dtype), weight_dtype=dtype(c.weight_dtype))
    if c.q_lora_rank == 0:
      self.wq = DenseGeneral((e,), (h, qk), ("embed", "heads", "head_dim"), **kw)
      self.wq_a = self.q_norm = self.wq_b = None
    else:
      self.wq = None
      self.wq_a = DenseGeneral((e,), (c.q_lora_rank,), ("embed", "q_lora"), **kw)
      self.q_norm = RMSNorm(c.q_lora_rank, c.normalization_layer_epsilon, **nkw)
      self.wq_b = DenseGeneral((c.q_lora_rank,), (h, qk), ("q_lora", "heads", "head_dim"), **kw)
    self.wkv_a = DenseGeneral((e,), (c.kv_lora_rank + c.qk_rope_head_dim,), ("embed", "kv_lora"), **kw)
    self.kv_norm = RMSNorm(c.kv_lora_rank, c.normalization_layer_epsilon, **nkw)
    self.wkv_b = DenseGeneral((c.kv_lora_rank,), (h, c.qk_nope_head_dim + c.v_head_dim), ("kv_lora", "heads", "head_dim"), **kw)
    self.out = DenseGeneral((h, c.v_head_dim), (e,), ("heads", "head_dim", "embed"), **kw)
    self.scale = softmax_scale(c)
    self.context = context_parallel.Layout.of(c)
    # An explicit kernel that cannot run this model fails here, at build time, as a one-line config error.
    attention_ops.select(policy, dtype=dtype(c.dtype), head_dim=qk, q_len=c.max_target_length, kv_len=c.max_target_length, soft_cap=c.attn_logits_soft_cap)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, window: int | jax.Array) -> jax.Array:
    c = self.config
    rules = c.logical_axis_rules
    nope, rope_dim = c.qk_nope_head_dim, c.qk_rope_head_dim
    q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
    q = checkpoint_name(q, "query_proj")
    kv_a = checkpoint_name(self.wkv_a(x), "kv_wa_proj")
    latent, k_rope = kv_a[..., : c.kv_lora_rank], kv_a[..., c.kv_lora_rank :]
    kv = checkpoint_name(self.wkv_b(self.kv_norm(latent)), "key_proj")  # [B,S,H,nope+v]
    k_nope, v = kv[..., :nope], kv[..., nope:]
    inv_freq, rope_scale = rope_frequencies(c)
    rot = dict(interleave=c.rope_interleave, scale=rope_scale)
    q_rope = rope.apply_rope(q[..., nope:], positions, inv_freq, **rot)
    k_rope = rope.apply_rope(k_rope[:, :, None, :], positions, inv_freq, **rot)  # [B,S,1,rope], shared by all heads
    q = jnp.concatenate([q[..., :nope], q_rope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:-1] + (rope_dim,))], axis=-1)
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), rules)
    k = constrain(k, ("activation_batch", "activation_length", "activation_heads", None), rules)
    v = constrain(v, ("activation_batch", "activation_length", "activation_heads", None), rules)
    ctx = attention_ops.attend(
      q,
      k,
      v,
      q_positions=positions,
      kv_positions=positions,
      segment_ids=segment_ids,
      window=window,
      soft_cap=c.attn_logits_soft_cap,
      scale=self.scale,
      policy=self.policy,
      precision=precision(c.matmul_precision),
      rules=rules,
      context=self.context,
    )
    ctx = checkpoint_name(ctx, "context")
    return checkpoint_name(self.out(ctx), "out_proj")
