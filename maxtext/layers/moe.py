"""Mixture of experts: routing (Mixtral, Qwen3-MoE, DeepSeek V3), dropless or capacity-limited dispatch, shared experts.

Routing (float32): scores are softmax or sigmoid (routed_score_func) of the router logits (with routed_bias and
softmax scores, the router has a trained bias on its logits: gpt-oss). Experts are chosen by top-k of the scores
plus, with sigmoid scores, an optional score-correction bias (routed_bias, DeepSeek's aux-loss-free balancing),
optionally only inside the best topk_routing_group of n_routing_groups groups (each group scored by the sum of
its two best biased scores). The chosen experts' weights are the unbiased scores, renormalised to sum to one
with norm_topk_prob (always for mixtral; with softmax scores that is a softmax over the chosen experts' logits,
as gpt-oss computes it), times routed_scaling_factor.

Experts: gated MLPs act0(x wi_0) * act1(x wi_1) -> wo, or gpt-oss's clamped SwiGLU (maxtext.layers.mlp.gated);
with mlp_bias every projection adds a per-expert bias. With `quantization` every expert product is quantized
(maxtext.layers.quantization.expert_product); a stored recipe (QLoRA, decoding) keeps each expert weight quantized
with its `<name>_scale`.

Dispatch: dropless (capacity_factor = -1) sorts the (token, expert) pairs by expert and runs grouped matmuls
(jax.lax.ragged_dot); with capacity_factor > 0 every expert takes at most
ceil(capacity_factor x tokens x k / experts) tokens (earlier tokens first), the rest are dropped (counted in
the metrics), and experts run as one batched matmul over [experts, capacity] buffers.

Expert parallelism: when the active mesh has an `expert` axis of size ep > 1, each device owns
num_experts / ep experts. Routing runs on the global (sharded) arrays; then, in shard_map, every device
packs its own tokens into [experts, capacity] buffers, an all-to-all over `expert` sends each expert's
slots to the device that owns it, the owner runs its experts, and a second all-to-all brings the results
back. Capacity then applies per data shard; without capacity_factor it is the shard's token count, which
no expert can exceed (dropless, at the price of buffers num_experts / k times the routed pairs).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.config import MaxTextConfig
from maxtext.layers import quantization
from maxtext.layers.dtypes import dtype, precision
from maxtext.layers.linear import DenseGeneral, variance_scaling_init
from maxtext.layers.mlp import MLP, gated
from maxtext.mesh import logical_to_spec
from maxtext.platform import Policy


class RoutingBias(nnx.Variable):
  """DeepSeek's per-expert score-correction bias: not trained by gradients, moved by the aux-loss-free update."""


class Routing(NamedTuple):
  weights: jax.Array  # [T, k] float32 combine weights of the chosen experts
  experts: jax.Array  # [T, k] int32 chosen experts
  probs: jax.Array  # [T, E] float32 routing probabilities (for the load-balance loss)


def route(logits: jax.Array, config: MaxTextConfig, bias: jax.Array | None = None) -> Routing:
  """Choose num_experts_per_tok experts per token from router logits [T, E] (see the module docstring)."""
  c = config
  logits = logits.astype(jnp.float32)
  scores = jax.nn.sigmoid(logits) if c.routed_score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  if c.n_routing_groups > 0:
    t, e = choice.shape
    grouped = choice.reshape(t, c.n_routing_groups, e // c.n_routing_groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
    _, best_groups = jax.lax.top_k(group_scores, c.topk_routing_group)
    keep = jnp.sum(jax.nn.one_hot(best_groups, c.n_routing_groups, dtype=jnp.bool_), axis=1)  # [T, G]
    choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)
  _, experts = jax.lax.top_k(choice, c.num_experts_per_tok)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if c.norm_topk_prob or c.decoder_block == "mixtral":
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  probs = scores if c.routed_score_func != "sigmoid" else scores / jnp.sum(scores, axis=-1, keepdims=True)
  return Routing(weights * c.routed_scaling_factor, experts, probs)


def load_balance_loss(probs: jax.Array, experts: jax.Array, valid: jax.Array) -> jax.Array:
  """Switch-style auxiliary loss: E * sum_e (fraction of routed slots to e) * (mean router prob of e), over valid tokens."""
  w = valid.astype(jnp.float32)[:, None]
  chosen = jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32).sum(axis=1)  # [T,E]
  return load_balance_from_sums(jnp.sum(chosen * w, axis=0), jnp.sum(probs * w, axis=0), jnp.sum(w), experts.shape[-1])


def load_balance_from_sums(load: jax.Array, prob_sum: jax.Array, tokens: jax.Array, k: int) -> jax.Array:
  """load_balance_loss from its sums over valid tokens: load [..., E] routed slots, prob_sum [..., E] router
  probabilities, tokens [...] the count. Sums add over microbatches, so a pipeline gets the full batch's loss."""
  denom = jnp.maximum(tokens, 1.0)[..., None]
  return load.shape[-1] * jnp.sum(load / (denom * k) * (prob_sum / denom), axis=-1)


def bias_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing (DeepSeek V3): raise the bias of under-loaded experts, lower over-loaded ones, by rate.

  load [..., E]: tokens routed to each expert this step; bias [..., E].
  """
  mean = jnp.mean(load, axis=-1, keepdims=True)
  return bias + rate * jnp.sign(mean - load).astype(bias.dtype)


def update_routing_biases(other: nnx.State, load: jax.Array, config: MaxTextConfig) -> nnx.State:
  """Apply bias_update to the routing bias of every main-model MoE layer in a non-Param state.

  load [MoE layers, num_experts] is what the step's forward pass routed (the multi-token-prediction
  modules' biases are left as they are).
  """
  leaves = []
  for path, var in nnx.to_flat_state(other):
    keys = [str(p) for p in path]
    if keys[0] == "layers" and keys[-1] == "routed_bias":
      layer_load = load if config.scan_layers else load[int(keys[1])]
      var = var.replace(bias_update(var[...], layer_load, config.routed_bias_update_rate))
    leaves.append((path, var))
  return nnx.from_flat_state(leaves)


def expert_capacity(tokens: int, config: MaxTextConfig) -> int:
  """Slots per expert: ceil(capacity_factor x tokens x k / experts) (at least 1)."""
  c = config
  return max(1, math.ceil(c.capacity_factor * tokens * c.num_experts_per_tok / c.num_experts))


def capacity_positions(experts: jax.Array, num_experts: int) -> jax.Array:
  """[T, k] experts -> each pair's arrival index at its expert, earlier tokens first (a token's k picks in order)."""
  flat = jax.nn.one_hot(experts.reshape(-1), num_experts, dtype=jnp.int32)  # [T*k, E]
  before = jnp.cumsum(flat, axis=0) - flat
  return jnp.sum(before * flat, axis=-1).reshape(experts.shape)


def sort_by_expert(tokens: jax.Array, experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Dropless dispatch: tokens [T, E], experts [T, k] -> (pairs sorted by expert [T*k, E], their order, group sizes)."""
  k = experts.shape[-1]
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  return tokens[order // k], order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def unsort_combine(out: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
  """Dropless combine: expert outputs [T*k, E] in sorted order -> weighted sum per token [T, E] (float32)."""
  t, k = weights.shape
  slots = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)
  return jnp.einsum("tke,tk->te", slots.astype(jnp.float32), weights)


def pack(tokens: jax.Array, experts: jax.Array, kept: jax.Array, position: jax.Array, capacity: int, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """Capacity dispatch: kept (token, expert) pairs into [experts, capacity, E] buffers; returns (buffers, slot of each pair).

  Dropped pairs point at one extra overflow row that is cut off (and reads zeros in unpack_combine).
  """
  k = experts.shape[-1]
  slot = jnp.where(kept, experts * capacity + position, num_experts * capacity)
  buffer = jnp.zeros((num_experts * capacity + 1, tokens.shape[-1]), tokens.dtype)
  buffer = buffer.at[slot.reshape(-1)].set(jnp.repeat(tokens, k, axis=0))[:-1]
  return buffer.reshape(num_experts, capacity, -1), slot


def unpack_combine(out: jax.Array, slot: jax.Array, weights: jax.Array) -> jax.Array:
  """Capacity combine: expert outputs [experts, capacity, E] -> weighted sum per token [T, E] (float32); dropped pairs add 0."""
  flat = out.reshape(-1, out.shape[-1])
  gathered = jnp.concatenate([flat, jnp.zeros((1, flat.shape[-1]), flat.dtype)])[slot]  # [T, k, E]
  return jnp.einsum("tke,tk->te", gathered.astype(jnp.float32), weights)


def empty_stats(num_experts: int) -> dict[str, jax.Array]:
  """The statistics of a layer without experts (same structure as MoE's)."""
  zero, experts = jnp.zeros((), jnp.float32), jnp.zeros((num_experts,), jnp.float32)
  return {"lb_loss": zero, "dropped": zero, "load": experts, "router_probs": experts, "tokens": zero}


class MoE(nnx.Module):
  """Routed experts' weights stacked [num_experts, ...], plus optional shared experts (one dense MLP)."""

  def __init__(self, config: MaxTextConfig, *, policy: Policy, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.dtype = dtype(c.dtype)
    self.precision = precision(c.matmul_precision)
    wdt = dtype(c.weight_dtype)
    e, m, n = c.emb_dim, c.moe_mlp_dim, c.num_experts
    logit_bias = c.routed_bias and c.routed_score_func != "sigmoid"  # gpt-oss: the router's own bias; deepseek: a score correction
    self.gate = DenseGeneral(
      (e,),
      (n,),
      ("embed", None),
      dtype=jnp.float32,
      weight_dtype=wdt,
      precision=self.precision,
      rngs=rngs,
      integer_rounding=policy.integer_bf16_rounding,
      use_bias=logit_bias,
    )
    self.quant = policy.quantization
    for name, (fan_in, fan_out), axes in (
      ("wi_0", (e, m), ("exp", "embed", "mlp")),
      ("wi_1", (e, m), ("exp", "embed", "mlp")),
      ("wo", (m, e), ("exp", "mlp", "embed")),
    ):
      param, scale = quantization.expert_weight(variance_scaling_init(rngs.params(), (n, fan_in, fan_out), fan_in, wdt), axes, self.quant)
      setattr(self, name, param)
      setattr(self, name + quantization.SCALE_SUFFIX, scale)
    if c.mlp_bias:
      self.wi_0_bias = nnx.Param(jnp.zeros((n, m), wdt), logical_axes=("exp", "mlp"))
      self.wi_1_bias = nnx.Param(jnp.zeros((n, m), wdt), logical_axes=("exp", "mlp"))
      self.wo_bias = nnx.Param(jnp.zeros((n, e), wdt), logical_axes=("exp", "embed"))
    else:
      self.wi_0_bias = self.wi_1_bias = self.wo_bias = None
    self.routed_bias = RoutingBias(jnp.zeros((n,), jnp.float32), logical_axes=(None,)) if c.routed_bias and not logit_bias else None
    self.shared_experts = MLP(c, policy=policy, rngs=rngs, width=c.shared_experts * m) if c.shared_experts else None

  def _weights(self) -> dict[str, jax.Array]:
    """The experts' stacked kernels (and biases, with mlp_bias; scales of stored quantized kernels) by name."""
    names = ("wi_0", "wi_1", "wo") + (("wi_0_bias", "wi_1_bias", "wo_bias") if self.wo_bias is not None else ())
    names += tuple(n + quantization.SCALE_SUFFIX for n in ("wi_0", "wi_1", "wo") if getattr(self, n + quantization.SCALE_SUFFIX) is not None)
    return {name: getattr(self, name)[...] for name in names}

  def _experts(self, lhs: jax.Array, w: dict[str, jax.Array], project, rows) -> jax.Array:
    """The experts' gated MLP on dispatched rows: project(h, kernel, scale) is the dispatch path's expert matmul (scale: a
    stored quantized kernel's, else None) and rows(bias [E, F]) gives each row of h its expert's bias."""

    def proj(h: jax.Array, name: str) -> jax.Array:
      y = project(h, w[name], w.get(name + quantization.SCALE_SUFFIX))
      return y + rows(w[name + "_bias"]).astype(y.dtype) if name + "_bias" in w else y

    h = gated(self.config)(checkpoint_name(proj(lhs, "wi_0"), "mlpwi_0"), checkpoint_name(proj(lhs, "wi_1"), "mlpwi_1"))
    return proj(h, "wo")

  def _dropless(self, tokens: jax.Array, r: Routing) -> jax.Array:
    """Every (token, expert) pair computed: sort by expert, grouped matmuls, unsort, weighted sum."""
    routed, order, group_sizes = sort_by_expert(tokens, r.experts, self.config.num_experts)
    row_expert = r.experts.reshape(-1)[order]

    def grouped(lhs: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
      if self.quant is not None:
        return quantization.expert_product(lhs, w, scale, self.quant, self.dtype, group_sizes)
      return jax.lax.ragged_dot(lhs, w.astype(self.dtype), group_sizes, precision=self.precision)

    return unsort_combine(self._experts(routed, self._weights(), grouped, lambda b: b[row_expert]), order, r.weights)

  def _with_capacity(self, tokens: jax.Array, r: Routing, kept: jax.Array, position: jax.Array, capacity: int) -> jax.Array:
    """Kept pairs scattered into [experts, capacity] buffers, one batched matmul per projection, gathered back."""
    c = self.config
    buffer, slot = pack(tokens, r.experts, kept, position, capacity, c.num_experts)
    return unpack_combine(self._experts(buffer, self._weights(), self._batched, lambda b: b[:, None, :]), slot, r.weights)

  def _batched(self, lhs: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """[experts, rows, in] x [experts, in, out] -> [experts, rows, out] in the compute dtype."""
    if self.quant is not None:
      return quantization.expert_product(lhs, w, scale, self.quant, self.dtype)
    return jnp.einsum("ecd,edf->ecf", lhs, w.astype(self.dtype), precision=self.precision, preferred_element_type=jnp.float32).astype(self.dtype)

  def _expert_parallel(self, x: jax.Array, r: Routing, valid: jax.Array, mesh: jax.sharding.AbstractMesh) -> tuple[jax.Array, jax.Array]:
    """Dispatch by all-to-all over the `expert` mesh axis (see the module docstring) -> (y [B,S,E] float32, dropped)."""
    c = self.config
    b, s, e = x.shape
    k, n, ep = c.num_experts_per_tok, c.num_experts, mesh.shape["expert"]
    if n % ep:
      raise ValueError(f"num_experts {n} is not divisible by the expert mesh axis {ep}")
    x_spec = logical_to_spec(("activation_batch", "activation_length", "activation_embed"), c.logical_axis_rules, mesh)
    routed_spec = jax.sharding.PartitionSpec(*x_spec[:2], None)
    token_axes = tuple(a for part in x_spec for a in ((part,) if isinstance(part, str) else (part or ())))
    weights_all = self._weights()
    w_spec = {name: jax.sharding.PartitionSpec("expert", *([None] * (w.ndim - 1))) for name, w in weights_all.items()}

    def local(x, weights, experts, valid, w):
      lb, ls, _ = x.shape
      t = lb * ls
      tokens, experts, weights = x.reshape(t, e), experts.reshape(t, k), weights.reshape(t, k)
      capacity = expert_capacity(t, c) if c.capacity_factor > 0 else t
      position = capacity_positions(experts, n)
      kept = position < capacity
      buffer, slot = pack(tokens.astype(self.dtype), experts, kept, position, capacity, n)
      buffer = jax.lax.all_to_all(buffer, "expert", 0, 0, tiled=True)  # [source x local experts, C, E]
      buffer = buffer.reshape(ep, n // ep, capacity, e).swapaxes(0, 1).reshape(n // ep, ep * capacity, e)
      out = self._experts(buffer, w, self._batched, lambda b: b[:, None, :])
      out = out.reshape(n // ep, ep, capacity, e).swapaxes(0, 1).reshape(n, capacity, e)
      out = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True)
      y = unpack_combine(out, slot, weights).reshape(lb, ls, e)
      dropped = jnp.sum(jnp.where(kept, 0.0, 1.0) * valid.reshape(t, 1))
      return y, jax.lax.psum(dropped, token_axes) if token_axes else dropped

    fn = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(x_spec, routed_spec, routed_spec, jax.sharding.PartitionSpec(*x_spec[:2]), w_spec),
      out_specs=(x_spec, jax.sharding.PartitionSpec()),
    )
    routed = (r.weights.reshape(b, s, k), r.experts.reshape(b, s, k))
    return fn(x.astype(self.dtype), *routed, valid.reshape(b, s), weights_all)

  def __call__(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B,S,E], valid [B,S] bool (tokens counted in the statistics) -> (y [B,S,E], statistics).

    Statistics: lb_loss (load-balance loss), dropped (valid (token, expert) pairs over capacity),
    load [num_experts] (valid tokens routed to each expert, before dropping), router_probs [num_experts] and tokens (the sums
    of valid tokens' router probabilities and of valid tokens, from which load_balance_from_sums gives lb_loss).
    """
    c = self.config
    b, s, e = x.shape
    tokens = x.reshape(b * s, e).astype(self.dtype)
    valid = valid.reshape(-1)
    r = route(self.gate(tokens), c, self.routed_bias[...] if self.routed_bias is not None else None)
    chosen = jax.nn.one_hot(r.experts, c.num_experts, dtype=jnp.float32)  # [T,k,E]
    load = jnp.einsum("tke,t->e", chosen, valid.astype(jnp.float32))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get("expert", 1) > 1:
      y, dropped = self._expert_parallel(x, r, valid, mesh)
    elif c.capacity_factor > 0:
      capacity = expert_capacity(b * s, c)
      position = capacity_positions(r.experts, c.num_experts)
      kept = position < capacity
      y = self._with_capacity(tokens, r, kept, position, capacity)
      dropped = jnp.sum(jnp.where(kept, 0.0, 1.0) * valid[:, None])
    else:
      y = self._dropless(tokens, r)
      dropped = jnp.zeros((), jnp.float32)
    y = y.astype(self.dtype).reshape(b, s, e)
    if self.shared_experts is not None:
      y = y + self.shared_experts(x)
    w = valid.astype(jnp.float32)
    probs, tokens = jnp.einsum("te,t->e", r.probs, w), jnp.sum(w)
    stats = {
      "lb_loss": load_balance_from_sums(load, probs, tokens, c.num_experts_per_tok),
      "dropped": dropped,
      "load": load,
      "router_probs": probs,
      "tokens": tokens,
    }
    return checkpoint_name(y, "mlpwo"), stats
