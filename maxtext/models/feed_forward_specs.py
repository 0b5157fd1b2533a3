"""The feed-forward specs a LayerKind's ffn names (FEED_FORWARDS): the dense MLP, routed experts beside shared ones, and
DeepSeek V4's clamped and hashed experts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError
from maxtext.layers import grouped_matmul as gmm
from maxtext.layers.mlp import MLPSpec
from maxtext.layers.moe import MoESpec, RoutingSpec
from maxtext.models.common_specs import family_of, norm, rules
from maxtext.models.family import Family


def mlp(config: MaxTextConfig, width: int | None = None) -> MLPSpec:
  """The dense MLP of width mlp_dim (or width)."""
  return MLPSpec(config.emb_dim, config.mlp_dim if width is None else width, tuple(config.mlp_activations), rules(config))


def grouped_tiles(config: MaxTextConfig) -> tuple[gmm.Tiles, gmm.Tiles]:
  """Megablox blocks (rows, contracted, produced) of wi_0/wi_1 and of wo, from MaxText's wi_tile_*/wo_tile_* keys."""
  c = config
  wi = gmm.Tiles(
    fwd=(c.wi_tile_fwd_batch_seq, c.wi_tile_fwd_embed_dim, c.wi_tile_fwd_mlp_dim),
    dlhs=(c.wi_tile_dlhs_batch_seq, c.wi_tile_dlhs_mlp_dim, c.wi_tile_dlhs_embed_dim),
    drhs=(c.wi_tile_drhs_batch_seq, c.wi_tile_drhs_embed_dim, c.wi_tile_drhs_mlp_dim),
  )
  wo = gmm.Tiles(
    fwd=(c.wo_tile_fwd_batch_seq, c.wo_tile_fwd_mlp_dim, c.wo_tile_fwd_embed_dim),
    dlhs=(c.wo_tile_dlhs_batch_seq, c.wo_tile_dlhs_embed_dim, c.wo_tile_dlhs_mlp_dim),
    drhs=(c.wo_tile_drhs_batch_seq, c.wo_tile_drhs_mlp_dim, c.wo_tile_drhs_embed_dim),
  )
  return wi, wo


def moe(config: MaxTextConfig, family: Family | None = None, shared: bool | None = None) -> MoESpec:
  """The routed experts (num_experts > 1) and, with shared (default: shared_experts > 0), shared_experts shared experts;
  family defaults to decoder_block's."""
  c = config
  shared = bool(c.shared_experts) if shared is None else shared
  if shared and not c.shared_experts:
    raise ConfigError(f"decoder_block={c.decoder_block} has MoE layers with shared experts; set shared_experts >= 1")
  family = family or family_of(c)
  if family.expert_input_weights and c.num_experts_per_tok != 1:
    raise ConfigError(
      f"decoder_block={c.decoder_block} weights each expert's input, which is built for top-1 routing only; set num_experts_per_tok=1 (was {c.num_experts_per_tok})"
    )
  sigmoid = c.routed_score_func == "sigmoid" or family.expert_input_weights  # Llama 4's router: sigmoid of the top-1 logit
  per_expert = sigmoid or c.routed_score_func == "sqrtsoftplus"  # per-expert scores: routed_bias is a score correction
  routing = RoutingSpec(
    num_experts=c.num_experts,
    k=c.num_experts_per_tok,
    score_func="sigmoid" if sigmoid else c.routed_score_func,
    groups=c.n_routing_groups,
    topk_groups=c.topk_routing_group,
    renormalize=c.norm_topk_prob or family.renormalize_topk,
    scaling_factor=c.routed_scaling_factor,
  )
  wi, wo = grouped_tiles(c)
  return MoESpec(
    emb_dim=c.emb_dim,
    width=c.moe_mlp_dim,
    routing=routing,
    activations=tuple(c.mlp_activations),
    glu_limit=float(c.mlp_activations_limit) if family.clamped_glu else 0.0,
    router_bias=c.routed_bias and not per_expert,  # gpt-oss: the router's own bias; deepseek: a score correction
    score_correction=c.routed_bias and per_expert,
    expert_bias=c.mlp_bias,
    shared=(mlp(c) if family.experts_beside_dense_mlp else mlp(c, c.shared_experts * c.moe_mlp_dim)) if shared else None,
    shared_gate=shared and family.shared_expert_gate,
    input_weights=family.expert_input_weights,
    router_norm=norm(c, family) if family.experts_beside_dense_mlp else None,
    expert_scales=family.experts_beside_dense_mlp,
    separate_norms=norm(c, family) if family.experts_beside_dense_mlp else None,
    capacity_factor=c.capacity_factor,
    ragged_buffer_factor=c.ragged_buffer_factor,
    gather_chunks=c.expert_gather_chunks,
    wi_tiles=wi,
    wo_tiles=wo,
    rules=rules(c),
  )


def deepseek4_moe(config: MaxTextConfig, family: Family, hashed: bool) -> MoESpec:
  """DeepSeek V4's experts beside shared ones, both with its clamped SwiGLU act0(min(h0, L)) * act1(clip(h1, -L, L))
  (L = mlp_activations_limit); hashed: experts fixed per token id by a tid2eid table of vocab_size rows, no score
  correction."""
  c = config
  spec = moe(c, family, shared=True)
  limit = float(c.mlp_activations_limit)
  shared = dataclasses.replace(spec.shared, glu_limit=limit, glu_clamp_only=True)
  return dataclasses.replace(
    spec,
    glu_limit=limit,
    glu_clamp_only=True,
    shared=shared,
    hash_vocab=c.vocab_size if hashed else 0,
    score_correction=spec.score_correction and not hashed,
  )


FEED_FORWARDS: dict[str, Callable[[MaxTextConfig, Family], Any]] = {
  "dense": lambda config, family: mlp(config),
  "moe": lambda config, family: moe(config, family, shared=False),
  "moe_shared": lambda config, family: deepseek4_moe(config, family, hashed=False) if family.deepseek4_keys else moe(config, family, shared=True),
  "moe_hash": lambda config, family: deepseek4_moe(config, family, hashed=True),
}
