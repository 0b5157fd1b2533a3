"""Counting reads the built model: the parameter count is the abstract tree's, for every family and option, and
counting.py names no module path. Training FLOPs count what runs: hand computations for a tiny config under LoRA
(frozen base, adapters, skipped gradients below the lowest adapter), several adapter slots, and mHC (projections,
mixing, Sinkhorn); the figures the hand-kept counting gave for MLA, MoE, MTP and sliding windows; expert biases."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from flax import nnx

from maxtext import counting, models
from maxtext.config import from_overrides
from tests.test_model_files import TINY, TINY_LAYER
from tests.test_moe_families import DEEPSEEK, GEMMA3, GPT_OSS, QWEN3_MOE

LORA = {"enable_lora": True, "lora_rank": 2}
FAMILIES = {
  "dense": dict(num_devices=1, **TINY),
  "tied": dict(num_devices=1, logits_via_embedding=True, **TINY),
  "moe": dict(QWEN3_MOE),
  "mla_mtp": dict(DEEPSEEK),  # MLA, a dense first layer, shared experts, the routing bias and one MTP module
  "mhc": dict(num_devices=1, mhc_expansion_rate=2, **TINY),
  "lora": dict(num_devices=1, lora=LORA, **TINY),
  "lora_mla": dict(DEEPSEEK, lora=dict(LORA, lora_module_path="attention/(wq_b|wkv_a)$|mlp/gate$")),
  "lora_slots_mhc_unscanned": dict(num_devices=1, scan_layers=False, mhc_expansion_rate=2, lora=dict(LORA, max_lora_adapters=2), **TINY),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_param_count_is_the_built_trees(name):
  config = from_overrides(**FAMILIES[name])
  state = nnx.state(models.abstract_model(config))
  assert counting.param_count(config) == sum(math.prod(v.shape) for _, v in nnx.to_flat_state(state))


def test_counting_names_no_module_path():
  """Module paths live in the model alone: counting.py holds no 'attention/...' or 'mlp/...' string."""
  tree = ast.parse(Path(counting.__file__).read_text())
  docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n)}
  strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]
  assert strings and not [s for s in strings if "/" in s]


# (training, forward) FLOPs per step the hand-kept counting gave (before it read the model), for the families whose
# layers differ most: MLA with a dense first layer, shared experts and MTP (and LoRA below and above its attention
# core), qk-norm MoE, gemma3's 5:1 sliding windows, gpt-oss's attention biases and sinks.
TODAY = {
  "deepseek": (DEEPSEEK, 18536988672, 4587257856),
  "deepseek_lora_wkv_b": (dict(DEEPSEEK, lora=dict(LORA, lora_module_path="attention/wkv_b$")), 17995923456, 4595515392),
  "deepseek_lora_gate_out": (dict(DEEPSEEK, lora=dict(LORA, lora_module_path="mlp/gate$|attention/out$")), 15188754432, 4600233984),
  "qwen3_moe": (QWEN3_MOE, 10378543104, 3459514368),
  "gemma3": (GEMMA3, 7370440704, 2456813568),
  "gpt_oss_unbiased_experts": (dict(GPT_OSS, mlp_bias=False, routed_bias=False), 5589762048, 1863254016),
}


@pytest.mark.parametrize("name", sorted(TODAY))
def test_flops_are_the_hand_kept_countings(name):
  overrides, training, forward = TODAY[name]
  config = from_overrides(**overrides)
  assert (counting.training_flops_per_step(config), counting.forward_flops_per_step(config)) == (training, forward)


def test_expert_and_router_biases_count_as_they_run():
  """gpt-oss's expert biases (num_experts_per_tok of them per token) and router bias: 6 FLOPs per entry a token uses."""
  biased, plain = from_overrides(**GPT_OSS), from_overrides(**dict(GPT_OSS, mlp_bias=False, routed_bias=False))
  c = biased
  tokens = c.global_batch_size_to_train_on * c.max_target_length
  per_layer = c.num_experts_per_tok * (2 * c.moe_mlp_dim + c.emb_dim) + c.num_experts
  extra = counting.training_flops_per_step(biased) - counting.training_flops_per_step(plain)
  assert extra == 6 * tokens * c.num_decoder_layers * per_layer


TOKENS = 2 * 16  # one device x 2 sequences x 16 tokens
SCORES = 2 * TOKENS * 16 * 2 * 4  # forward attention scores of one layer: 2 T x keys x heads x head_dim
HEAD = 8 + 32 * 8  # final norm + output projection
# (fan_in + fan_out) of the adapted projections: q 8+8, k 8+4, v 8+4, out 8+8, wi_0 8+16, wi_1 8+16, wo 16+8.
ADAPTED_SIDES = 16 + 12 + 12 + 16 + 24 + 24 + 24


def test_full_training_is_six_per_parameter():
  config = from_overrides(num_devices=1, **TINY)
  assert counting.training_flops_per_step(config) == 6 * TOKENS * (2 * TINY_LAYER + HEAD) + 2 * 3 * SCORES


def test_lora_counts_no_base_weight_gradients():
  config = from_overrides(num_devices=1, lora={"enable_lora": True, "lora_rank": 2}, **TINY)
  base = 4 * TINY_LAYER  # forward + input gradient, no weight gradient
  adapters = 2 * 6 * ADAPTED_SIDES  # r x (forward, weight grads, rank-axis and input gradients)
  # Lowest layer: nothing below trains, so q/k/v and their norm pass no input gradient, nor do their adapters.
  bottom = base - 2 * (8 * 8 + 8 * 4 + 8 * 4) - 2 * 8 + adapters - 2 * 2 * (8 + 8 + 8)
  per_token = (base + adapters) + bottom + 4 * HEAD
  assert counting.training_flops_per_step(config) == TOKENS * per_token + 2 * 3 * SCORES
  full = counting.training_flops_per_step(from_overrides(num_devices=1, **TINY))
  assert counting.training_flops_per_step(config) < full


def test_lora_on_the_last_projection_skips_everything_below_it_in_the_lowest_layer():
  config = from_overrides(num_devices=1, lora={"enable_lora": True, "lora_rank": 2, "lora_module_path": "mlp/wo$"}, **TINY)
  upper = 4 * TINY_LAYER + 2 * 6 * (16 + 8)
  bottom = 2 * TINY_LAYER + 2 * (4 * (16 + 8) + 2 * 8)  # forward only; wo's adapter: no input gradient
  attention = 3 * SCORES + SCORES  # the lowest layer's attention runs forward only
  assert counting.training_flops_per_step(config) == TOKENS * (upper + bottom + 4 * HEAD) + attention


def test_adapter_slots_all_run_at_max_rank():
  lora = {"enable_lora": True, "lora_rank": 2, "max_lora_adapters": 3, "max_lora_rank": 4, "lora_adapters": ["a", "b:1", "c:4"]}
  config = from_overrides(num_devices=1, lora=lora, **TINY)
  single = from_overrides(num_devices=1, lora={"enable_lora": True, "lora_rank": 12}, **TINY)  # 3 slots x rank 4 = rank 12
  assert counting.training_flops_per_step(config) == counting.training_flops_per_step(single)
  assert counting.lora_params_per_layer(config) == 3 * 4 * ADAPTED_SIDES


def test_mhc_counts_projections_mixing_and_sinkhorn():
  config = from_overrides(num_devices=1, mhc_expansion_rate=2, sinkhorn_iterations=20, **TINY)
  n, e = 2, 8
  params = n * e * (2 * n + n * n + 1) + 2 * n + n * n + 3  # one connection: 155
  mixing = 3 * 2 * e * (2 * n + n * n)  # forward, H gradients, stream and branch gradients
  sinkhorn = 3 * (2 * 20 * 4 * n * n + n * n)
  connection = 6 * params + mixing + sinkhorn
  assert connection == 930 + 384 + 1932
  per_token = 6 * (2 * TINY_LAYER + HEAD) + 2 * 2 * connection
  assert counting.training_flops_per_step(config) == TOKENS * per_token + 2 * 3 * SCORES
