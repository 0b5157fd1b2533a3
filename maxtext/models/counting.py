"""Parameter counts and training FLOPs computed analytically from a resolved config.

Used by metrics (TFLOP/s/device, MFU), AOT reports and the model-file tests. No
model is built: every number follows from the config's dimensions.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from maxtext.models import registry

if TYPE_CHECKING:
  from maxtext.config import MaxTextConfig


def _attention_shapes(c: MaxTextConfig) -> dict[str, tuple[int, int]]:
  """Attention projections as (fan_in, fan_out), keyed by module path inside a layer."""
  e, h, kv, d = c.emb_dim, c.num_query_heads, c.num_kv_heads, c.head_dim
  if registry.get(c.decoder_block).mla:
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = {"attention/wq": (e, h * qk)} if c.q_lora_rank == 0 else {"attention/wq_a": (e, c.q_lora_rank), "attention/wq_b": (c.q_lora_rank, h * qk)}
    return q | {
      "attention/wkv_a": (e, c.kv_lora_rank + c.qk_rope_head_dim),
      "attention/wkv_b": (c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim)),
      "attention/out": (h * c.v_head_dim, e),
    }
  return {"attention/query": (e, h * d), "attention/key": (e, kv * d), "attention/value": (e, kv * d), "attention/out": (h * d, e)}


def _dense_mlp_shapes(c: MaxTextConfig, width: int | None = None, prefix: str = "mlp") -> dict[str, tuple[int, int]]:
  """Dense MLP projections: gated (wi_0, wi_1, wo) with two activations, else (wi, wo); width defaults to mlp_dim."""
  e, m = c.emb_dim, c.mlp_dim if width is None else width
  if len(c.mlp_activations) == 2:
    return {f"{prefix}/wi_0": (e, m), f"{prefix}/wi_1": (e, m), f"{prefix}/wo": (m, e)}
  return {f"{prefix}/wi": (e, m), f"{prefix}/wo": (m, e)}


def _moe_dense_shapes(c: MaxTextConfig) -> dict[str, tuple[int, int]]:
  """Dense projections of a MoE layer: the router and the shared experts (the routed experts are stacked)."""
  shapes = {"mlp/gate": (c.emb_dim, c.num_experts)}
  if c.shared_experts:
    shapes.update(_dense_mlp_shapes(c, c.shared_experts * c.moe_mlp_dim, "mlp/shared_experts"))
  return shapes


def _attention_norms(c: MaxTextConfig) -> int:
  """Vectors inside attention: qk-norm scales per head, or MLA's latent norms; q/k/v/o biases and sinks (gpt_oss)."""
  if registry.get(c.decoder_block).mla:
    return c.q_lora_rank + c.kv_lora_rank
  biases = (c.num_query_heads + 2 * c.num_kv_heads) * c.head_dim + c.emb_dim if c.attention_bias else 0
  return (2 * c.head_dim if c.use_qk_norm else 0) + biases + (c.num_query_heads if c.attention_sink else 0)


def _norms_per_layer(c: MaxTextConfig) -> int:
  """RMSNorm scales of size emb_dim per layer: 4 for families with post-branch norms (gemma2, gemma3), else 2."""
  return 4 if registry.get(c.decoder_block).post_norms else 2


def mhc_params_per_layer(c: MaxTextConfig) -> int:
  """mHC parameters of one decoder layer (two sub-blocks: attention and MLP); 0 when mhc_expansion_rate is 1.

  Per sub-block, with n = mhc_expansion_rate and C = emb_dim:
  W_pre (nC x n) + W_post (nC x n) + W_res (nC x n^2) + b_pre (n) + b_post (n) + b_res (n^2)
  + 3 scalar gates (alpha_pre, alpha_post, alpha_res) + RMSNorm scale (nC)
  = nC (2n + n^2 + 1) + 2n + n^2 + 3.
  """
  n, dim = c.mhc_expansion_rate, c.emb_dim
  if n <= 1:
    return 0
  wide = n * dim
  per_sub_block = wide * (2 * n + n * n) + (2 * n + n * n) + 3 + wide
  return 2 * per_sub_block


def lora_slots(c: MaxTextConfig) -> tuple[int, int]:
  """(adapter slots, rank of each slot's matrices): (1, lora_rank), or (max_lora_adapters, max_lora_rank)."""
  if c.lora.max_lora_adapters == 1:
    return 1, c.lora.lora_rank
  return c.lora.max_lora_adapters, c.lora.max_lora_rank or c.lora.lora_rank


def _adapted_shapes(c: MaxTextConfig, dense: bool = False) -> dict[str, tuple[int, int]]:
  """(fan_in, fan_out) of every projection lora.lora_module_path gives an adapter ({} without LoRA)."""
  if not c.lora.enable_lora:
    return {}
  pattern = re.compile(c.lora.lora_module_path)
  shapes = _attention_shapes(c)
  shapes.update(_moe_dense_shapes(c) if c.num_experts > 1 and not dense else _dense_mlp_shapes(c))
  return {path: shape for path, shape in shapes.items() if pattern.search(path)}


def lora_params_per_layer(c: MaxTextConfig, dense: bool = False) -> int:
  """LoRA adapter parameters of one layer: slots x r (fan_in + fan_out) for every dense projection lora.lora_module_path matches.

  Candidate modules are the attention projections (attention/query, key, value, out), the dense MLP
  projections (mlp/wi_0, mlp/wi_1 or mlp/wi, mlp/wo) and, for MoE layers, the router (mlp/gate); stacked
  expert weights take no adapters. The default path matches attention q/k/v/out and the MLP wi_0/wi_1/wo.
  With lora.max_lora_adapters > 1 every slot holds max_lora_rank columns (lower adapter ranks are masked).
  """
  slots, rank = lora_slots(c)
  return sum(slots * rank * (fan_in + fan_out) for fan_in, fan_out in _adapted_shapes(c, dense).values())


def params_per_layer(c: MaxTextConfig, active_only: bool = False, dense: bool = False) -> int:
  """Parameters of one decoder layer (attention, MLP or MoE, norms, optional qk-norm, mHC, LoRA).

  A MoE layer holds the router, num_experts (active_only: num_experts_per_tok) routed experts of width
  moe_mlp_dim (with mlp_bias, 2 moe_mlp_dim + emb_dim biases each), shared experts, and the routing bias;
  dense=True counts a dense layer of a MoE model (first_num_dense_layers).
  """
  total = sum(i * o for i, o in _attention_shapes(c).values()) + _attention_norms(c)
  if c.num_experts > 1 and not dense:
    experts = c.num_experts_per_tok if active_only else c.num_experts
    per_expert = 3 * c.emb_dim * c.moe_mlp_dim + ((2 * c.moe_mlp_dim + c.emb_dim) if c.mlp_bias else 0)
    total += sum(i * o for i, o in _moe_dense_shapes(c).values()) + experts * per_expert
    total += c.num_experts if c.routed_bias else 0
  else:
    total += sum(i * o for i, o in _dense_mlp_shapes(c).values())
  total += _norms_per_layer(c) * c.emb_dim
  return total + mhc_params_per_layer(c) + lora_params_per_layer(c, dense)


def mtp_params(c: MaxTextConfig, active_only: bool = False) -> int:
  """Multi-token-prediction modules: per module two input norms, the [2E, E] projection, one MoE decoder layer
  and an output norm (embedding and output head are shared with the main model)."""
  per_module = 3 * c.emb_dim + 2 * c.emb_dim * c.emb_dim + params_per_layer(c, active_only)
  return c.mtp_num_layers * per_module


def param_count(config: MaxTextConfig, include_embedding: bool = True, active_only: bool = False) -> int:
  """Number of model parameters.

  first_num_dense_layers dense layers + the other layers x params_per_layer + final norm (emb_dim)
  + multi-token-prediction modules, plus, with include_embedding, the token embedding (vocab x emb)
  and a separate output projection (emb x vocab) unless logits_via_embedding ties the two (tied
  weights are counted once). active_only counts num_experts_per_tok experts per MoE layer instead of all of them.
  """
  c = config
  n_dense = c.first_num_dense_layers
  total = n_dense * params_per_layer(c, active_only, dense=True) + (c.num_decoder_layers - n_dense) * params_per_layer(c, active_only)
  total += c.emb_dim + mtp_params(c, active_only)
  if include_embedding:
    total += c.vocab_size * c.emb_dim * (1 if c.logits_via_embedding else 2)
  return total


def attended_keys(config: MaxTextConfig) -> int:
  """Keys each query attends to, summed over layers: min(seq, window) on sliding-window layers, seq elsewhere.

  The per-layer windows come from the decoder family (gemma2, gpt_oss: even layers local, odd layers global;
  gemma3: five local layers then one global; other families: sliding_window_size on every layer, 0 = full attention).
  """
  seq = config.max_target_length
  return sum(min(seq, w) if w > 0 else seq for w in registry.get(config.decoder_block).layer_windows(config))


def attention_width(c: MaxTextConfig) -> float:
  """Mean of the query-key and value widths per head: head_dim, or (nope + rope + v) / 2 for MLA."""
  if registry.get(c.decoder_block).mla:
    return (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2
  return c.head_dim


SINKHORN_FLOPS_PER_ENTRY = 4  # one log-domain normalisation: subtract the max, exp, sum, subtract the log-sum
_ATTENTION_CORE_STAGE = 1


def _stage(path: str) -> int:
  """Stage of a projection inside a layer, bottom to top: attention inputs 0, the attention core 1, attention out 2,
  MLP/MoE inputs 3 (router, wi, shared-expert wi), MLP outputs 4. A gradient is needed at a stage's input only if
  something below it trains; norms belong to the stage they feed."""
  if path.startswith("attention/"):
    return 2 if path == "attention/out" else 0
  return 4 if path.endswith("/wo") else 3


def _matmul(params: int, weight_grad: bool, input_grad: bool) -> int:
  """FLOPs per token of a weight of `params` entries: forward 2, input gradient 2, weight gradient 2."""
  return 2 * params * (1 + int(weight_grad) + int(input_grad))


def mhc_flops_per_connection(c: MaxTextConfig, input_grad: bool = True) -> int:
  """Training FLOPs per token of one mHC connection (its connectors always train).

  Projections (norm scale, W_pre, W_post, W_res, biases and gates): 6 per parameter, 4 without the input
  gradient. Stream mixing, forward sum_k H_pre[k] x_k (2nE), sum_k H_res[m,k] x_k (2n^2 E) and H_post[m] y
  (2nE); backward the H gradients (same), the gradient to y (2nE) and, with input_grad, to the streams
  (2nE + 2n^2 E). Sinkhorn: sinkhorn_iterations x 2 normalisations of n^2 entries at
  SINKHORN_FLOPS_PER_ENTRY each, plus the final exp; its backward twice that. Recomputation under remat is
  not counted (model FLOPs, as for every other layer).
  """
  n, e = c.mhc_expansion_rate, c.emb_dim
  params = mhc_params_per_layer(c) // 2
  mixing_forward = 2 * e * (2 * n + n * n)
  mixing = 2 * mixing_forward + 2 * n * e + (2 * e * (n + n * n) if input_grad else 0)
  sinkhorn = 3 * (2 * c.sinkhorn_iterations * SINKHORN_FLOPS_PER_ENTRY * n * n + n * n)
  return _matmul(params, True, input_grad) + mixing + sinkhorn


def layer_flops_per_token(c: MaxTextConfig, bottom: bool = False, dense: bool = False) -> int:
  """Training FLOPs per token of one decoder layer's weights (attention scores excluded); dense=True: a dense layer
  of a MoE model (first_num_dense_layers).

  Full training: 6 per parameter (routed experts: the num_experts_per_tok a token reaches). With LoRA the base is
  frozen: 2 forward + 2 for the input gradient, no weight gradient; each adapter (fan_in, fan_out) costs
  2 r (fan_in + fan_out) forward, the same for its weight gradients, 2 r fan_out for the gradient into its rank
  axis and 2 r fan_in for its input gradient, for each of the slots (all slots run on every row). `bottom` is the
  lowest layer of a LoRA run without mHC: nothing below it trains, so no input gradient is computed below its
  lowest adapter.
  """
  adapted = _adapted_shapes(c, dense)
  frozen = bool(c.lora.enable_lora)
  lowest = min((_stage(p) for p in adapted), default=0) if (bottom and frozen and c.mhc_expansion_rate == 1) else -1

  def needs_dx(stage: int) -> bool:
    return stage > lowest

  total = 0
  for path, (fan_in, fan_out) in _attention_shapes(c).items():
    total += _matmul(fan_in * fan_out, not frozen, needs_dx(_stage(path)))
  norm_stages = [0, 3] + ([2, 4] if registry.get(c.decoder_block).post_norms else [])  # pre-norms; post-norms follow a branch
  total += sum(_matmul(c.emb_dim, not frozen, needs_dx(stage)) for stage in norm_stages)
  total += _matmul(_attention_norms(c), not frozen, needs_dx(0))
  if c.num_experts > 1 and not dense:
    total += sum(_matmul(i * o, not frozen, needs_dx(_stage(p))) for p, (i, o) in _moe_dense_shapes(c).items())
    total += _matmul(c.num_experts_per_tok * 2 * c.emb_dim * c.moe_mlp_dim, not frozen, needs_dx(3))
    total += _matmul(c.num_experts_per_tok * c.emb_dim * c.moe_mlp_dim, not frozen, needs_dx(4))
  else:
    total += sum(_matmul(i * o, not frozen, needs_dx(_stage(p))) for p, (i, o) in _dense_mlp_shapes(c).items())
  slots, rank = lora_slots(c)
  for path, (fan_in, fan_out) in adapted.items():
    total += slots * rank * (4 * (fan_in + fan_out) + 2 * fan_out + (2 * fan_in if needs_dx(_stage(path)) else 0))
  if c.mhc_expansion_rate > 1:  # the lowest connection of a LoRA run passes no gradient to the (frozen) embedding
    total += mhc_flops_per_connection(c, input_grad=not (bottom and frozen)) + mhc_flops_per_connection(c)
  return total


def training_flops_per_step(config: MaxTextConfig) -> float:
  """Model FLOPs of one optimizer step over the whole global batch (forward + backward), as they run.

  With T = global_batch_size_to_train_on x max_target_length tokens: T x (layer_flops_per_token summed over
  layers + the final norm and the output matmul, 6 per parameter, 4 with a frozen base, + per MTP module its
  layer, input norms and [2E, E] projection and another output matmul) + causal attention scores,
  2 T x keys x heads x attention_width forward and twice that backward per layer (and MTP module), where
  sliding-window layers see min(seq, sliding_window_size) keys. The lowest layer of a LoRA run without
  mHC skips the attention backward when no adapter sits on its attention inputs.
  """
  c = config
  tokens = c.global_batch_size_to_train_on * c.max_target_length
  frozen = bool(c.lora.enable_lora)
  n_dense, layers = c.first_num_dense_layers, c.num_decoder_layers
  kinds = [True] * n_dense + [False] * (layers - n_dense)  # dense?
  per_token = sum(layer_flops_per_token(c, bottom=i == 0, dense=d) for i, d in enumerate(kinds))
  head = _matmul(c.emb_dim + c.vocab_size * c.emb_dim, not frozen, True)
  mtp = layer_flops_per_token(c) + _matmul(3 * c.emb_dim + 2 * c.emb_dim * c.emb_dim, not frozen, True) + head
  per_token += head + c.mtp_num_layers * mtp
  seq = c.max_target_length
  keys = [min(seq, w) if w > 0 else seq for w in registry.get(c.decoder_block).layer_windows(c)] + [seq] * c.mtp_num_layers
  scores = [2 * tokens * k * c.num_query_heads * attention_width(c) for k in keys]
  bottom_adapted = _adapted_shapes(c, dense=bool(n_dense))
  bottom_backward = not (frozen and c.mhc_expansion_rate == 1) or min((_stage(p) for p in bottom_adapted), default=0) < _ATTENTION_CORE_STAGE
  attention = sum(3 * s for s in scores) - (0 if bottom_backward or not scores else 2 * scores[0])
  return float(tokens * per_token + attention)


def forward_flops_per_step(config: MaxTextConfig) -> float:
  """Model FLOPs of one forward pass over the global batch without gradients (a reference or scoring pass):
  2 per active parameter per token (the embedding lookup excluded, the output matmul included) plus the causal
  attention scores, 2 T x keys x heads x attention_width per layer."""
  c = config
  tokens = c.global_batch_size_to_train_on * c.max_target_length
  params = param_count(c, include_embedding=False, active_only=True) - mtp_params(c, active_only=True) + c.vocab_size * c.emb_dim
  seq = c.max_target_length
  keys = [min(seq, w) if w > 0 else seq for w in registry.get(c.decoder_block).layer_windows(c)]
  return float(2 * tokens * params + sum(2 * tokens * k * c.num_query_heads * attention_width(c) for k in keys))


def step_flops(config: MaxTextConfig) -> float:
  """Model FLOPs of one train step as the run's objective makes it: one training pass, plus DPO's reference forward;
  GRPO: num_iterations training passes plus the scoring forwards (old log-probabilities when num_iterations > 1,
  reference log-probabilities when grpo_beta > 0). GRPO's rollout decoding is not counted (its length varies)."""
  c = config
  if c.use_dpo:
    return training_flops_per_step(c) + forward_flops_per_step(c)
  if c.use_grpo:
    forwards = int(c.num_iterations > 1) + int(c.grpo_beta > 0)
    return c.num_iterations * training_flops_per_step(c) + forwards * forward_flops_per_step(c)
  return training_flops_per_step(c)


def flops_per_device_per_step(config: MaxTextConfig) -> float:
  """step_flops divided evenly over config.num_devices."""
  return step_flops(config) / config.num_devices
