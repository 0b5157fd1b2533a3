"""Mixture of experts: routing (Mixtral, Qwen3-MoE, DeepSeek V3, gpt-oss), dropless or capacity-limited dispatch, shared experts.

Routing (float32): scores are softmax or sigmoid (routed_score_func) of the router logits (with routed_bias and
softmax scores, the router has a trained bias on its logits: gpt-oss). Experts are chosen by top-k of the scores
plus, with sigmoid scores, an optional score-correction bias (routed_bias, DeepSeek's aux-loss-free balancing),
optionally only inside the best topk_routing_group of n_routing_groups groups (each group scored by the sum of
its two best biased scores). The chosen experts' weights are the unbiased scores, renormalised to sum to one
with RoutingSpec.renormalize (norm_topk_prob, or a family that always renormalises; with softmax scores that is a softmax over the chosen experts' logits,
as gpt-oss computes it), times routed_scaling_factor.

With MoESpec.input_weights (Llama 4, top-1) the chosen expert's weight multiplies its input instead: E(w x).
With MoESpec.router_norm the router reads rms_norm(x) * scale / sqrt(emb_dim) (a learned per-feature scale); with
MoESpec.expert_scales each chosen weight is then multiplied by its expert's learned scale.

With MoESpec.separate_norms the layer hands the MoE both its pre-normed branch input (the shared experts read it) and
the un-normed one: the router reads the un-normed input, the routed experts their own pre-norm of it, and the shared
and routed outputs each pass their own post-norm before they add (Gemma 4's experts beside its dense MLP).

Experts: gated MLPs act0(x wi_0) * act1(x wi_1) -> wo, or gpt-oss's clamped SwiGLU (maxtext.layers.mlp.glu);
with mlp_bias every projection adds a per-expert bias. With `quantization` every expert product is quantized
(maxtext.layers.quantization.expert_product, through moe_dispatch.expert_matmul); a stored recipe (QLoRA, decoding)
keeps each expert weight quantized with its `<name>_scale`.

Dispatch (maxtext.layers.moe_dispatch): every device dispatches its own tokens in one shard_map, by the platform
policy's path (maxtext.platform.moe_dispatch, from MaxText's sparse_matmul / megablox / use_tokamax_gmm keys):
grouped matmuls over the (token, expert) pairs sorted by expert, or batched matmuls over [experts, slots] buffers.
Dropless by default (capacity_factor = -1); with capacity_factor > 0 each expert takes at most
ceil(capacity_factor x seq_len x k / experts) pairs of each sequence (earlier tokens first), the rest are dropped
and counted. With the experts split over a mesh axis that also splits the tokens (`expert`), rows travel to their
experts' devices by ragged_all_to_all (no capacity padding; ragged_buffer_factor > 0 bounds each device's receive
buffer and drops, and counts, the rows past it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.errors import ConfigError
from maxtext.layers import grouped_matmul as gmm
from maxtext.layers import moe_dispatch, quantization
from maxtext.layers.linear import DenseGeneral, dense_kwargs, variance_scaling_init
from maxtext.layers.mlp import MLP, MLPSpec
from maxtext.layers.norms import NormSpec, RMSNorm
from maxtext.layers.sharding import Rules, logical_to_spec
from maxtext.platform import Policy


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
  """How a MoE layer chooses its experts (see the module docstring)."""

  num_experts: int
  k: int  # num_experts_per_tok
  score_func: str = "softmax"  # routed_score_func: softmax | sigmoid | sqrtsoftplus (DeepSeek V4: sqrt(softplus(logit)))
  groups: int = 0  # n_routing_groups (0: no group limit)
  topk_groups: int = 0  # topk_routing_group: groups each token may choose from
  renormalize: bool = False  # chosen weights renormalised to sum to one (norm_topk_prob; always for Mixtral)
  scaling_factor: float = 1.0  # routed_scaling_factor


@dataclasses.dataclass(frozen=True)
class MoESpec:
  """A mixture-of-experts layer (maxtext.models.specs builds it)."""

  emb_dim: int
  width: int  # moe_mlp_dim: each expert's hidden width
  routing: RoutingSpec
  activations: tuple[str, ...]  # mlp_activations of the experts' gate
  glu_limit: float = 0.0  # > 0: the family's clamped SwiGLU with mlp_activations_limit (gpt-oss), maxtext.layers.mlp.glu
  glu_clamp_only: bool = False  # the clamped SwiGLU in DeepSeek V4's form act0(min(h0, L)) * act1(clip(h1, -L, L))
  hash_vocab: int = 0  # > 0: hash routing (DeepSeek V4's first layers): each token id's experts fixed by a tid2eid table [hash_vocab, k]
  router_bias: bool = False  # the router has a trained bias on its logits (routed_bias with softmax scores: gpt-oss)
  score_correction: bool = False  # a per-expert score-correction bias moved by the aux-loss-free update (routed_bias with sigmoid: DeepSeek)
  expert_bias: bool = False  # mlp_bias: every expert projection adds a per-expert bias
  shared: MLPSpec | None = None  # shared experts (shared_experts x width), run on every token
  shared_gate: bool = False  # the shared experts' output is scaled per token by sigmoid(x w_gate) (Qwen3-Next's shared_expert_gate)
  input_weights: bool = False  # top-1: the routing weight scales the chosen expert's input, not its output (Llama 4)
  router_norm: NormSpec | None = None  # the router reads rms_norm(x) * scale / sqrt(emb_dim), scale learned per feature
  expert_scales: bool = False  # each chosen expert's weight is multiplied by a learned per-expert scale
  separate_norms: NormSpec | None = None  # router and routed experts read the un-normed input; each output its own post-norm (see the module docstring)
  capacity_factor: float = -1.0  # > 0: each expert takes at most ceil(factor x seq_len x k / experts) pairs per sequence
  ragged_buffer_factor: float = -1.0  # > 0: expert-parallel receive buffers hold int(tokens x k x factor) rows (moe_dispatch)
  gather_chunks: int = 0  # expert_gather_chunks: chunks of a device's experts run one after the other; 0: by GATHER_CHUNK_BYTES
  wi_tiles: gmm.Tiles = gmm.Tiles()  # megablox blocks of wi_0/wi_1 (MaxText's wi_tile_* keys)
  wo_tiles: gmm.Tiles = gmm.Tiles()  # megablox blocks of wo (wo_tile_* keys)
  rules: Rules = ()  # logical_axis_rules


class RoutingBias(nnx.Variable):
  """DeepSeek's per-expert score-correction bias: not trained by gradients, moved by the aux-loss-free update."""


class HashRouting(nnx.Variable):
  """DeepSeek V4's tid2eid: the experts of each token id [vocab, k], fixed (from the checkpoint; never trained)."""


class Routing(NamedTuple):
  weights: jax.Array  # [T, k] float32 combine weights of the chosen experts
  experts: jax.Array  # [T, k] int32 chosen experts
  probs: jax.Array  # [T, E] float32 routing probabilities (for the load-balance loss)


SCORE_FUNCS = ("", "softmax", "sigmoid", "sqrtsoftplus")  # "": softmax


def route(logits: jax.Array, spec: RoutingSpec, bias: jax.Array | None = None, fixed: jax.Array | None = None) -> Routing:
  """Choose spec.k experts per token from router logits [T, E] (see the module docstring); fixed [T, k]: the experts
  are given (hash routing: DeepSeek V4's tid2eid of each token), the scores only weight them."""
  if spec.score_func not in SCORE_FUNCS:
    raise ValueError(f"unknown routed_score_func {spec.score_func!r}; one of {', '.join(SCORE_FUNCS)}")
  logits = logits.astype(jnp.float32)
  sigmoid = spec.score_func in ("sigmoid", "sqrtsoftplus")  # per-expert scores (not a distribution): sigmoid, or sqrt(softplus)
  if spec.score_func == "sqrtsoftplus":
    scores = jnp.sqrt(jax.nn.softplus(logits))
  else:
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
  if fixed is not None:
    return _weighted(scores, fixed.astype(jnp.int32), spec, sigmoid)
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  if spec.groups > 0:
    t, e = choice.shape
    grouped = choice.reshape(t, spec.groups, e // spec.groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
    _, best_groups = jax.lax.top_k(group_scores, spec.topk_groups)
    keep = jnp.sum(jax.nn.one_hot(best_groups, spec.groups, dtype=jnp.bool_), axis=1)  # [T, G]
    choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)
  _, experts = jax.lax.top_k(choice, spec.k)
  return _weighted(scores, experts, spec, sigmoid)


def _weighted(scores: jax.Array, experts: jax.Array, spec: RoutingSpec, sigmoid: bool) -> Routing:
  """The Routing of the chosen experts [T, k]: their unbiased scores, renormalised as spec says, times its factor."""
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if spec.renormalize:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  probs = scores if not sigmoid else scores / jnp.sum(scores, axis=-1, keepdims=True)
  return Routing(weights * spec.scaling_factor, experts, probs)


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


def update_routing_biases(other: nnx.State, load: jax.Array, rate: float, scanned: bool, slots: list[tuple[str, int | None]] | None = None) -> nnx.State:
  """Apply bias_update (routed_bias_update_rate `rate`) to the routing bias of every main-model MoE layer in a
  non-Param state; scanned: the layers are stacked (scan_layers).

  load [MoE layers, num_experts] is what the step's forward pass routed, in the order of the stacks 'layers' then
  'layers_outside_pipeline' (the multi-token-prediction modules' biases are left as they are); with slots (each
  MoE layer's parameter prefix and stacked index, maxtext.models.layer_pattern.parameter_slots), in layer order.
  """
  rows: dict[str, list[tuple[int | None, int]]] = {}  # parameter prefix -> (stacked index, load row) of its layers
  for row, (prefix, index) in enumerate(slots or ()):
    rows.setdefault(prefix, []).append((index, row))
  leaves = []
  for path, var in nnx.to_flat_state(other):
    keys = [str(p) for p in path]
    prefix = "/".join(keys[:-2])
    if slots is not None and keys[-1] == "routed_bias" and prefix in rows:
      order = [row for _, row in rows[prefix]]  # layer order: the stacked index increases with it
      layer_load = load[order[0]] if rows[prefix][0][0] is None else load[jnp.asarray(order)]
      var = var.replace(bias_update(var[...], layer_load, rate))
    elif slots is None and keys[0] in ("layers", "layers_outside_pipeline") and keys[-1] == "routed_bias":
      n = var[...].shape[0]
      layer_load = (load[:n] if keys[0] == "layers" else load[-n:]) if scanned else load[int(keys[1])]
      var = var.replace(bias_update(var[...], layer_load, rate))
    leaves.append((path, var))
  return nnx.from_flat_state(leaves)


def expert_capacity(seq_len: int, spec: MoESpec) -> int:
  """Slots per expert in each sequence: ceil(capacity_factor x seq_len x k / experts) (at least 1)."""
  r = spec.routing
  return max(1, math.ceil(spec.capacity_factor * seq_len * r.k / r.num_experts))


def capacity_positions(experts: jax.Array, num_experts: int) -> jax.Array:
  """experts [..., S, k] -> each pair's arrival index at its expert within its sequence, earlier tokens first."""
  return moe_dispatch.sequence_positions(experts, num_experts)


GATHER_CHUNK_BYTES = 2 << 30  # expert_gather_chunks=0: the most one gathered expert matrix of a chunk may take


def gather_chunks(spec: MoESpec, layout: moe_dispatch.Layout, dtype: jax.typing.DTypeLike) -> int:
  """How many chunks a device's experts run in (moe_dispatch.Plan.expert_chunks): spec.gather_chunks when set (it must
  divide the device's experts); otherwise 1 unless the dispatch gathers the expert weights, then the fewest chunks,
  dividing the device's experts, whose gathered [experts, emb, width] matrix fits GATHER_CHUNK_BYTES."""
  local = spec.routing.num_experts // layout.size(layout.experts)
  if spec.gather_chunks:
    if local % spec.gather_chunks:
      raise ConfigError(
        f"expert_gather_chunks={spec.gather_chunks} does not divide the {local} experts each device runs "
        "(num_experts / expert parallelism); pick a divisor, or 0 to choose by size"
      )
    return spec.gather_chunks
  if not any(moe_dispatch.gathered(layout)["wi"]):
    return 1
  matrix = spec.emb_dim * spec.width * jnp.dtype(dtype).itemsize
  return next(c for c in range(1, local + 1) if local % c == 0 and local // c * matrix <= GATHER_CHUNK_BYTES or c == local)


def dispatch_plan(spec: MoESpec, policy: Policy, seq_len: int, layout: moe_dispatch.Layout) -> moe_dispatch.Plan:
  """The static dispatch of a MoE layer: the policy's path (maxtext.platform.moe_dispatch), tiles, capacity per
  sequence, the chunks of the experts (gather_chunks; the sparse paths only)."""
  path = policy.moe_dispatch
  kernel = gmm.Kernel("ragged_dot" if path == "dense" else path, interpret=policy.interpret_kernels, tokamax_implementation=policy.tokamax_implementation)
  return moe_dispatch.Plan(
    num_experts=spec.routing.num_experts,
    k=spec.routing.k,
    sparse=path != "dense",
    kernel=kernel,
    wi_tiles=spec.wi_tiles,
    wo_tiles=spec.wo_tiles,
    capacity=expert_capacity(seq_len, spec) if spec.capacity_factor > 0 else 0,
    ragged_buffer_factor=spec.ragged_buffer_factor,
    expert_chunks=gather_chunks(spec, layout, policy.dtypes.compute) if path != "dense" else 1,
    activations=spec.activations,
    glu_limit=spec.glu_limit,
    glu_clamp_only=spec.glu_clamp_only,
    quantization=policy.quantization,
    dtype=policy.dtypes.compute,
    integer_rounding=policy.integer_bf16_rounding,
    ragged_all_to_all=policy.ragged_all_to_all,
  )


def dispatch_layout(
  batch: int, seq_len: int, rules, mesh: jax.sharding.AbstractMesh, scales: tuple[tuple[str | None, ...], tuple[str | None, ...]] | None = None
) -> moe_dispatch.Layout:
  """Mesh axes of the dispatch: tokens split as `activation_batch` x `activation_length` (the longest prefix of each
  rule's axes that divides the dimension), weights as stored; experts exchanged over their axes when those split tokens.
  scales: the logical axes of wi_0/wi_1's and wo's stored quantized scales (maxtext.layers.quantization.expert_weight)."""

  def axes(part) -> tuple[str, ...]:
    return (part,) if isinstance(part, str) else tuple(part or ())

  def dividing(names: tuple[str, ...], size: int) -> tuple[str, ...]:
    while names and size % math.prod(mesh.shape[a] for a in names):
      names = names[:-1]
    return names

  tokens = logical_to_spec(("activation_batch", "activation_length"), rules, mesh)
  batch_axes, length_axes = dividing(axes(tokens[0]), batch), dividing(axes(tokens[1]), seq_len)

  def stored(names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    spec = tuple(axes(p) for p in logical_to_spec(names, rules, mesh))
    return spec + ((),) * (len(names) - len(spec))

  wi, wo = stored(("exp", "embed", "mlp")), stored(("exp", "mlp", "embed"))
  wi_bias, wo_bias = stored(("exp", "mlp")), stored(("exp", "embed"))
  wi_scale, wo_scale = (stored(names) for names in scales) if scales else (((), (), ()),) * 2
  experts = wi[0] if wi[0] and set(wi[0]) <= set(batch_axes + length_axes) else ()
  return moe_dispatch.Layout(batch_axes, length_axes, experts, wi, wo, wi_bias, wo_bias, wi_scale, wo_scale, tuple(mesh.shape.items()))


def empty_stats(num_experts: int) -> dict[str, jax.Array]:
  """The statistics of a layer without experts (same structure as MoE's)."""
  zero, experts = jnp.zeros((), jnp.float32), jnp.zeros((num_experts,), jnp.float32)
  return {"lb_loss": zero, "dropped": zero, "load": experts, "router_probs": experts, "tokens": zero}


class MoE(nnx.Module):
  """Routed experts' weights stacked [num_experts, ...], plus optional shared experts (one dense MLP)."""

  def __init__(self, spec: MoESpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.policy = policy
    self.dtype = policy.dtypes.compute
    self.precision = policy.dtypes.precision
    wdt = policy.dtypes.params
    e, m, n = spec.emb_dim, spec.width, spec.routing.num_experts
    self.gate = DenseGeneral(
      (e,),
      (n,),
      ("embed", None),
      dtype=jnp.float32,
      weight_dtype=wdt,
      precision=self.precision,
      rngs=rngs,
      integer_rounding=policy.integer_bf16_rounding,
      use_bias=spec.router_bias,
    )
    for name, (fan_in, fan_out), axes in (
      ("wi_0", (e, m), ("exp", "embed", "mlp")),
      ("wi_1", (e, m), ("exp", "embed", "mlp")),
      ("wo", (m, e), ("exp", "mlp", "embed")),
    ):  # with a stored recipe (QLoRA, decoding): quantized values and their `<name>_scale`
      param, scale = quantization.expert_weight(variance_scaling_init(rngs.params(), (n, fan_in, fan_out), fan_in, wdt), axes, policy.quantization)
      setattr(self, name, param)
      setattr(self, name + quantization.SCALE_SUFFIX, scale)
    if spec.expert_bias:
      self.wi_0_bias = nnx.Param(jnp.zeros((n, m), wdt), logical_axes=("exp", "mlp"))
      self.wi_1_bias = nnx.Param(jnp.zeros((n, m), wdt), logical_axes=("exp", "mlp"))
      self.wo_bias = nnx.Param(jnp.zeros((n, e), wdt), logical_axes=("exp", "embed"))
    else:
      self.wi_0_bias = self.wi_1_bias = self.wo_bias = None
    self.routed_bias = RoutingBias(jnp.zeros((n,), jnp.float32), logical_axes=(None,)) if spec.score_correction else None
    hashed = jnp.arange(spec.hash_vocab * spec.routing.k, dtype=jnp.int32).reshape(-1, spec.routing.k) % n  # spread until loaded
    self.tid2eid = HashRouting(hashed, logical_axes=(None, None)) if spec.hash_vocab else None
    self.shared_experts = MLP(spec.shared, policy=policy, rngs=rngs) if spec.shared is not None else None
    gated = spec.shared is not None and spec.shared_gate
    self.shared_expert_gate = DenseGeneral((e,), (1,), ("embed", None), **dense_kwargs(policy, rngs)) if gated else None

    def norm(norm_spec: NormSpec | None) -> RMSNorm | None:
      return None if norm_spec is None else RMSNorm.of(e, norm_spec, policy.dtypes, zero_centered=False)

    self.router_norm = norm(spec.router_norm)
    self.per_expert_scale = nnx.Param(jnp.ones((n,), wdt), logical_axes=(None,)) if spec.expert_scales else None
    self.routed_pre_norm = norm(spec.separate_norms)
    self.routed_post_norm = norm(spec.separate_norms)
    self.shared_post_norm = norm(spec.separate_norms) if spec.shared is not None else None

  def __call__(
    self,
    x: jax.Array,
    valid: jax.Array,
    adapter_ids: jax.Array | None = None,
    unnormed: jax.Array | None = None,
    token_ids: jax.Array | None = None,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [B,S,E], valid [B,S] bool (tokens counted in the statistics) -> (y [B,S,E], statistics). adapter_ids [B] or
    [B,S]: each row's (or token's) LoRA slot, for the adapted router and shared experts. unnormed [B,S,E]: the
    branch's input before the layer's pre-norm, which the router and routed experts read with separate_norms.
    token_ids [B,S]: the input tokens, which pick a hash-routed layer's experts (hash_vocab).

    Statistics: lb_loss (load-balance loss), dropped (valid (token, expert) pairs over capacity),
    load [num_experts] (valid tokens routed to each expert, before dropping), router_probs [num_experts] and tokens (the sums
    of valid tokens' router probabilities and of valid tokens, from which load_balance_from_sums gives lb_loss).
    """
    spec = self.spec
    b, s, e = x.shape
    routed_in = router_in = x
    if spec.separate_norms is not None:
      if unnormed is None:
        raise ValueError("a MoE with separate_norms reads the branch's un-normed input; pass unnormed")
      router_in, routed_in = unnormed, self.routed_pre_norm(unnormed)
    if self.router_norm is not None:
      router_in = self.router_norm(router_in).astype(jnp.float32) * (e**-0.5)
    tokens = router_in.reshape(b * s, e).astype(self.dtype)
    valid = valid.reshape(-1)
    adapter_rows = None if adapter_ids is None else jnp.broadcast_to(adapter_ids.reshape(b, -1), (b, s)).reshape(-1)  # the router's rows are tokens
    fixed = None
    if self.tid2eid is not None:
      if token_ids is None:
        raise ValueError("a hash-routed MoE picks experts by token id; pass token_ids")
      fixed = self.tid2eid[...][token_ids.reshape(-1)]
    r = route(self.gate(tokens, adapter_rows), spec.routing, self.routed_bias[...] if self.routed_bias is not None else None, fixed)
    if self.per_expert_scale is not None:
      r = r._replace(weights=r.weights * self.per_expert_scale[...].astype(jnp.float32)[r.experts])
    chosen = jax.nn.one_hot(r.experts, spec.routing.num_experts, dtype=jnp.float32)  # [T,k,E]
    load = jnp.einsum("tke,t->e", chosen, valid.astype(jnp.float32))
    mesh = jax.sharding.get_abstract_mesh()
    single = mesh.empty or mesh.size == 1
    # the stored scales' logical axes: the last three (a scanned stack puts its layers axis first)
    scale_axes = None if self.wi_0_scale is None else tuple(v.get_metadata()["logical_axes"][-3:] for v in (self.wi_0_scale, self.wo_scale))
    layout = moe_dispatch.Layout() if single else dispatch_layout(b, s, spec.rules, mesh, scale_axes)
    names = moe_dispatch.ExpertWeights._fields
    weights = moe_dispatch.ExpertWeights(*(None if p is None else p[...] for p in (getattr(self, name) for name in names)))
    routed_x, combine = routed_in.astype(self.dtype), r.weights.reshape(b, s, -1)
    if spec.input_weights:  # one expert per token: its weight scales the expert's input, the output is taken whole
      routed_x, combine = routed_x * combine.astype(routed_x.dtype), jnp.ones_like(combine)
    plan = dispatch_plan(spec, self.policy, s, layout)
    y, dropped = moe_dispatch.dispatch(routed_x, combine, r.experts.reshape(b, s, -1), valid.reshape(b, s), weights, layout, plan, None if single else mesh)
    y = y.astype(self.dtype)
    if self.routed_post_norm is not None:
      y = self.routed_post_norm(y)
    if self.shared_experts is not None:
      shared = self.shared_experts(x, adapter_ids)
      if self.shared_expert_gate is not None:
        shared = shared * jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32)).astype(shared.dtype)
      if self.shared_post_norm is not None:
        shared = self.shared_post_norm(shared)
      y = y + shared
    w = valid.astype(jnp.float32)
    probs, tokens = jnp.einsum("te,t->e", r.probs, w), jnp.sum(w)
    stats = {
      "lb_loss": load_balance_from_sums(load, probs, tokens, spec.routing.k),
      "dropped": dropped,
      "load": load,
      "router_probs": probs,
      "tokens": tokens,
    }
    return checkpoint_name(y, "mlpwo"), stats
