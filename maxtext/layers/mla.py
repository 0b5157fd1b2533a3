"""Multi-head latent attention (DeepSeek V2/V3): low-rank query and key/value projections, decoupled rotary key.

Queries: x -> wq (q_lora_rank = 0), or x -> wq_a -> RMSNorm -> wq_b; each head is [nope | rope].
Keys and values: x -> wkv_a gives a kv_lora_rank latent (RMSNorm'd, then wkv_b expands it into per-head
key-nope and value parts) plus one qk_rope_head_dim rotary key shared by every head.
The attention itself runs on the same core as every other family (xla_attention.attention_mask/xla_attention).

Decoding with the compressed cache (mla_naive_kvcache=false) caches, per token, the normalised latent c_t and the
rotated shared key k_rope,t, and attends in the latent space (the absorbed form): with wkv_b = [W_uk | W_uv] per head,

    score_h(t) = scale ((W_uk,h^T q_nope,h) . c_t + q_rope,h . k_rope,t),   o_h = W_uv,h (sum_t softmax_h(t) c_t)

which equals attention over the expanded keys k_h(t) = [W_uk,h c_t | k_rope,t] and values W_uv,h c_t. The naive
form caches those expanded per-head keys and values instead.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.errors import ConfigError
from maxtext.layers import attention_ops, context_parallel, matmul, rope
from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.sharding import Rules, constrain
from maxtext.layers.xla_attention import head_major_attention
from maxtext.platform import Policy

if TYPE_CHECKING:
  from maxtext.layers.attention_ops import LayerCache


@dataclasses.dataclass(frozen=True)
class MLASpec:
  """Multi-head latent attention (maxtext.models.specs builds it)."""

  emb_dim: int
  num_heads: int
  q_lora_rank: int  # 0: queries by one projection wq
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  norm_epsilon: float  # the latents' RMSNorms (normalization_layer_epsilon)
  rope: rope.RopeSpec
  scale: float  # the softmax scale (softmax_scale)
  max_target_length: int  # the longest sequence, for the kernel check at build time
  soft_cap: float | None = None  # attn_logits_soft_cap
  context: context_parallel.Layout | None = None  # context parallelism's sequence layout (None: none)
  rules: Rules = ()  # logical_axis_rules


def softmax_scale(qk_head_dim: int, rope_spec: rope.RopeSpec, mscale: float) -> float:
  """1/sqrt(qk head dim), times YaRN's mscale^2 correction when the rope is yarn and mscale > 0."""
  scale = qk_head_dim**-0.5
  if rope_spec.kind == "yarn" and mscale > 0:
    scale *= rope.yarn_mscale(rope_spec.yarn_factor, mscale) ** 2
  return scale


class MLA(nnx.Module):
  """Multi-head latent attention. The kernel comes from policy (maxtext.platform); fused kernels see values
  zero-padded to the query/key width, and the padding is cut from their output."""

  def __init__(self, spec: MLASpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.policy = policy
    e, h = spec.emb_dim, spec.num_heads
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    kw = dense_kwargs(policy, rngs)
    nkw = dict(dtype=policy.dtypes.compute, weight_dtype=policy.dtypes.params)
    if spec.q_lora_rank == 0:
      self.wq = DenseGeneral((e,), (h, qk), ("embed", "heads", "head_dim"), **kw)
      self.wq_a = self.q_norm = self.wq_b = None
    else:
      self.wq = None
      self.wq_a = DenseGeneral((e,), (spec.q_lora_rank,), ("embed", "q_lora"), **kw)
      self.q_norm = RMSNorm(spec.q_lora_rank, spec.norm_epsilon, **nkw)
      self.wq_b = DenseGeneral((spec.q_lora_rank,), (h, qk), ("q_lora", "heads", "head_dim"), **kw)
    self.wkv_a = DenseGeneral((e,), (spec.kv_lora_rank + spec.qk_rope_head_dim,), ("embed", "kv_lora"), **kw)
    self.kv_norm = RMSNorm(spec.kv_lora_rank, spec.norm_epsilon, **nkw)
    self.wkv_b = DenseGeneral((spec.kv_lora_rank,), (h, spec.qk_nope_head_dim + spec.v_head_dim), ("kv_lora", "heads", "head_dim"), **kw)
    self.out = DenseGeneral((h, spec.v_head_dim), (e,), ("heads", "head_dim", "embed"), **kw)
    # An explicit kernel that cannot run this model fails here, at build time, as a one-line config error.
    attention_ops.select(policy, dtype=policy.dtypes.compute, head_dim=qk, q_len=spec.max_target_length, kv_len=spec.max_target_length, soft_cap=spec.soft_cap)

  def queries(self, x: jax.Array, adapter_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """x [B, S, E] -> (queries [B, S, H, nope + rope] before rotation, the normalised query latent [B, S, q_lora_rank]
    or None when q_lora_rank = 0)."""
    if self.wq is not None:
      return checkpoint_name(self.wq(x, adapter_ids), "query_proj"), None
    latent = self.q_norm(self.wq_a(x, adapter_ids))
    return checkpoint_name(self.wq_b(latent, adapter_ids), "query_proj"), latent

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    window: int | jax.Array,
    cache: LayerCache | None = None,
    adapter_ids: jax.Array | None = None,
  ):
    """-> output [B, S, E]; with a KV cache (decoding), -> (output, updated cache). adapter_ids: each row's (or
    token's) LoRA slot, for adapted projections."""
    spec = self.spec
    rules = spec.rules
    nope, rope_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim
    q, _ = self.queries(x, adapter_ids)
    kv_a = checkpoint_name(self.wkv_a(x, adapter_ids), "kv_wa_proj")
    latent, k_rope = self.kv_norm(kv_a[..., : spec.kv_lora_rank]), kv_a[..., spec.kv_lora_rank :]
    inv_freq, rope_scale = rope.layer_frequencies(spec.rope, rope_dim)
    rot = dict(interleave=spec.rope.interleave, scale=rope_scale)
    q_rope = rope.apply_rope(q[..., nope:], positions, inv_freq, **rot)
    k_rope = rope.apply_rope(k_rope[:, :, None, :], positions, inv_freq, **rot)  # [B,S,1,rope], shared by all heads
    if cache is not None and "latent" in cache.arrays:
      return self._absorbed(q[..., :nope], q_rope, latent, k_rope, cache, adapter_ids)
    kv = checkpoint_name(self.wkv_b(latent, adapter_ids), "key_proj")  # [B,S,H,nope+v]
    k_nope, v = kv[..., :nope], kv[..., nope:]
    q = jnp.concatenate([q[..., :nope], q_rope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:-1] + (rope_dim,))], axis=-1)
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), rules)
    k = constrain(k, ("activation_batch", "activation_length", "activation_heads", None), rules)
    v = constrain(v, ("activation_batch", "activation_length", "activation_heads", None), rules)
    if cache is not None:  # mla_naive_kvcache: per-head keys and values in the cache
      ctx, cache = cache.attend(q, k, v, 0, spec.scale, spec.soft_cap, self.policy.dtypes.precision, rules)
      return self.out(ctx, adapter_ids), cache
    ctx = attention_ops.attend(
      q,
      k,
      v,
      q_positions=positions,
      kv_positions=positions,
      segment_ids=segment_ids,
      window=window,
      soft_cap=spec.soft_cap,
      scale=spec.scale,
      policy=self.policy,
      precision=self.policy.dtypes.precision,
      rules=rules,
      context=spec.context,
    )
    ctx = checkpoint_name(ctx, "context")
    return checkpoint_name(self.out(ctx, adapter_ids), "out_proj")

  def _absorbed(
    self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, cache: LayerCache, adapter_ids: jax.Array | None
  ) -> tuple[jax.Array, LayerCache]:
    """Attention in the latent space over a compressed cache (the module docstring): W_uk folded into the queries, W_uv
    applied to the attended latent. q_nope [B,S,H,nope], q_rope [B,S,H,rope], latent [B,S,R], k_rope [B,S,1,rope]."""
    spec = self.spec
    if self.wkv_b.lora is not None:
      raise ConfigError(
        "decoding MLA from its compressed cache folds wkv_b into the queries, which a LoRA adapter on wkv_b prevents; merge the adapter or set mla_naive_kvcache=true"
      )
    prec, dt = self.policy.dtypes.precision, self.policy.dtypes.compute
    nope = spec.qk_nope_head_dim
    kernel = self.wkv_b.kernel[...]  # [R, H, nope + v]
    new = jnp.concatenate([latent, k_rope[:, :, 0, :].astype(latent.dtype)], axis=-1)[:, None]  # [B, 1, S, R + rope]
    cache, attended, mask = cache.update({"latent": new}, spec.rules)
    slots = attended["latent"]
    q_latent = matmul.einsum("bshn,rhn->bshr", q_nope, kernel[..., :nope], dtype=dt, precision=prec)
    query = jnp.concatenate([q_latent, q_rope.astype(dt)], axis=-1)  # [B, S, H, R + rope]
    out_latent = head_major_attention(query, slots, slots[..., : spec.kv_lora_rank], mask, spec.scale, spec.soft_cap, prec)
    ctx = matmul.einsum("bshr,rhv->bshv", out_latent, kernel[..., nope:], dtype=dt, precision=prec)
    return self.out(ctx, adapter_ids), cache
