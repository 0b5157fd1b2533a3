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
  return {"attention/query": (e, h * d), "attention/key": (e, kv * d), "attention/value": (e, kv * d), "attention/out": (h * d, e)}


def _dense_mlp_shapes(c: MaxTextConfig) -> dict[str, tuple[int, int]]:
  """Dense MLP projections: gated (wi_0, wi_1, wo) with two activations, else (wi, wo)."""
  e, m = c.emb_dim, c.mlp_dim
  if len(c.mlp_activations) == 2:
    return {"mlp/wi_0": (e, m), "mlp/wi_1": (e, m), "mlp/wo": (m, e)}
  return {"mlp/wi": (e, m), "mlp/wo": (m, e)}


def _norms_per_layer(c: MaxTextConfig) -> int:
  """RMSNorm scales of size emb_dim per layer: 4 for families with post-branch norms (gemma2), else 2."""
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


def _adapted_shapes(c: MaxTextConfig) -> dict[str, tuple[int, int]]:
  """(fan_in, fan_out) of every projection lora.lora_module_path gives an adapter ({} without LoRA)."""
  if not c.lora.enable_lora:
    return {}
  pattern = re.compile(c.lora.lora_module_path)
  shapes = _attention_shapes(c)
  shapes.update({"mlp/gate": (c.emb_dim, c.num_experts)} if c.num_experts > 1 else _dense_mlp_shapes(c))
  return {path: shape for path, shape in shapes.items() if pattern.search(path)}


def lora_params_per_layer(c: MaxTextConfig) -> int:
  """LoRA adapter parameters of one layer: slots x r (fan_in + fan_out) for every dense projection lora.lora_module_path matches.

  Candidate modules are the attention projections (attention/query, key, value, out), the dense MLP
  projections (mlp/wi_0, mlp/wi_1 or mlp/wi, mlp/wo) and, for MoE layers, the router (mlp/gate); stacked
  expert weights take no adapters. The default path matches attention q/k/v/out and the MLP wi_0/wi_1/wo.
  With lora.max_lora_adapters > 1 every slot holds max_lora_rank columns (lower adapter ranks are masked).
  """
  slots, rank = lora_slots(c)
  return sum(slots * rank * (fan_in + fan_out) for fan_in, fan_out in _adapted_shapes(c).values())


def params_per_layer(c: MaxTextConfig, active_only: bool = False) -> int:
  """Parameters of one decoder layer (attention, MLP or MoE, norms, optional qk-norm, mHC, LoRA)."""
  total = sum(i * o for i, o in _attention_shapes(c).values())
  if c.use_qk_norm:
    total += 2 * c.head_dim
  if c.num_experts > 1:
    experts = c.num_experts_per_tok if active_only else c.num_experts
    total += c.emb_dim * c.num_experts + experts * 3 * c.emb_dim * c.mlp_dim  # router + (wi_0, wi_1, wo) per expert
  else:
    total += sum(i * o for i, o in _dense_mlp_shapes(c).values())
  total += _norms_per_layer(c) * c.emb_dim
  return total + mhc_params_per_layer(c) + lora_params_per_layer(c)


def param_count(config: MaxTextConfig, include_embedding: bool = True, active_only: bool = False) -> int:
  """Number of model parameters.

  layers x params_per_layer + final norm (emb_dim), plus, with include_embedding, the token
  embedding (vocab x emb) and a separate output projection (emb x vocab) unless
  logits_via_embedding ties the two (tied weights are counted once). active_only counts
  num_experts_per_tok experts per MoE layer instead of all of them.
  """
  c = config
  total = c.num_decoder_layers * params_per_layer(c, active_only) + c.emb_dim
  if include_embedding:
    total += c.vocab_size * c.emb_dim * (1 if c.logits_via_embedding else 2)
  return total


def attended_keys(config: MaxTextConfig) -> int:
  """Keys each query attends to, summed over layers: min(seq, window) on sliding-window layers, seq elsewhere.

  The per-layer windows come from the decoder family (gemma2: even layers local, odd layers global;
  other families: sliding_window_size on every layer, 0 = full attention).
  """
  seq = config.max_target_length
  return sum(min(seq, w) if w > 0 else seq for w in registry.get(config.decoder_block).layer_windows(config))


# Stages of a decoder layer, bottom to top: a gradient is needed at a stage's input only if something
# below it trains. Norms belong to the stage they feed.
_STAGE_OF = {
  "attention/query": 0,
  "attention/key": 0,
  "attention/value": 0,
  "attention/out": 2,
  "mlp/gate": 3,
  "mlp/wi_0": 3,
  "mlp/wi_1": 3,
  "mlp/wi": 3,
  "mlp/wo": 4,
}
_ATTENTION_CORE_STAGE = 1
SINKHORN_FLOPS_PER_ENTRY = 4  # one log-domain normalisation: subtract the max, exp, sum, subtract the log-sum


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


def layer_flops_per_token(c: MaxTextConfig, bottom: bool = False) -> int:
  """Training FLOPs per token of one decoder layer's weights (attention scores excluded).

  Full training: 6 per parameter. With LoRA the base is frozen: 2 forward + 2 for the input gradient,
  no weight gradient; each adapter (fan_in, fan_out) costs 2 r (fan_in + fan_out) forward, the same for its
  weight gradients, 2 r fan_out for the gradient into its rank axis and 2 r fan_in for its input gradient,
  for each of the slots (all slots run on every row). `bottom` is the lowest layer of a LoRA run without
  mHC: nothing below it trains, so no input gradient is computed below its lowest adapter.
  """
  adapted = _adapted_shapes(c)
  frozen = bool(c.lora.enable_lora)
  lowest = min((_STAGE_OF[p] for p in adapted), default=0) if (bottom and frozen and c.mhc_expansion_rate == 1) else -1

  def needs_dx(stage: int) -> bool:
    return stage > lowest

  total = 0
  for path, (fan_in, fan_out) in _attention_shapes(c).items():
    total += _matmul(fan_in * fan_out, not frozen, needs_dx(_STAGE_OF[path]))
  norm_stages = [0, 3] + ([2, 4] if registry.get(c.decoder_block).post_norms else [])  # pre-norms; post-norms follow a branch
  total += sum(_matmul(c.emb_dim, not frozen, needs_dx(stage)) for stage in norm_stages)
  if c.use_qk_norm:
    total += _matmul(2 * c.head_dim, not frozen, needs_dx(0))
  if c.num_experts > 1:
    total += _matmul(c.emb_dim * c.num_experts, not frozen, needs_dx(3))
    total += _matmul(c.num_experts_per_tok * 2 * c.emb_dim * c.mlp_dim, not frozen, needs_dx(3))
    total += _matmul(c.num_experts_per_tok * c.emb_dim * c.mlp_dim, not frozen, needs_dx(4))
  else:
    total += sum(_matmul(i * o, not frozen, needs_dx(_STAGE_OF[p])) for p, (i, o) in _dense_mlp_shapes(c).items())
  slots, rank = lora_slots(c)
  for path, (fan_in, fan_out) in adapted.items():
    total += slots * rank * (4 * (fan_in + fan_out) + 2 * fan_out + (2 * fan_in if needs_dx(_STAGE_OF[path]) else 0))
  if c.mhc_expansion_rate > 1:  # the lowest connection of a LoRA run passes no gradient to the (frozen) embedding
    total += mhc_flops_per_connection(c, input_grad=not (bottom and frozen)) + mhc_flops_per_connection(c)
  return total


def training_flops_per_step(config: MaxTextConfig) -> float:
  """Model FLOPs of one optimizer step over the whole global batch (forward + backward), as they run.

  With T = global_batch_size_to_train_on x max_target_length tokens: T x (layer_flops_per_token summed
  over layers + the final norm and the output matmul, 6 per parameter, 4 with a frozen base) + causal
  attention scores, 2 T x keys x heads x head_dim forward and twice that backward per layer, where
  sliding-window layers see min(seq, sliding_window_size) keys. The lowest layer of a LoRA run without
  mHC skips the attention backward when no adapter sits on query, key or value.
  """
  c = config
  tokens = c.global_batch_size_to_train_on * c.max_target_length
  frozen = bool(c.lora.enable_lora)
  layers = c.num_decoder_layers
  per_token = (layers - 1) * layer_flops_per_token(c) + layer_flops_per_token(c, bottom=True) if layers else 0
  per_token += _matmul(c.emb_dim + c.vocab_size * c.emb_dim, not frozen, True)
  seq = c.max_target_length
  keys = [min(seq, w) if w > 0 else seq for w in registry.get(c.decoder_block).layer_windows(c)]
  scores = [2 * tokens * k * c.num_query_heads * c.head_dim for k in keys]
  bottom_backward = not (frozen and c.mhc_expansion_rate == 1) or min((_STAGE_OF[p] for p in _adapted_shapes(c)), default=0) < _ATTENTION_CORE_STAGE
  attention = sum(3 * s for s in scores) - (0 if bottom_backward or not scores else 2 * scores[0])
  return float(tokens * per_token + attention)


def flops_per_device_per_step(config: MaxTextConfig) -> float:
  """training_flops_per_step divided evenly over config.num_devices."""
  return training_flops_per_step(config) / config.num_devices
