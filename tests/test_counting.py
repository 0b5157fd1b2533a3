"""Training FLOPs count what runs: hand computations for a tiny config under LoRA (frozen base, adapters,
skipped gradients below the lowest adapter), several adapter slots, and mHC (projections, mixing, Sinkhorn)."""

from __future__ import annotations

from maxtext.config import from_overrides
from maxtext.models import counting
from tests.test_model_files import TINY, TINY_LAYER

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
