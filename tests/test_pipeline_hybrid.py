"""Pipeline parallelism of a hybrid layer pattern on 8 simulated CPU devices (float32): a tiny Qwen3-Next-shaped model
(blocks of 3 Gated DeltaNet layers + 1 gated attention layer, experts in every layer) pipelined block by block gives
the unpipelined model's loss and gradients; splits the blocks do not allow are one-line config errors.

The model is registered with tests/test_pipeline.py's helpers (MODELS), which place one set of perturbed parameters
into every layout and compare gradients in the checkpoints' plain layer order.
"""

from __future__ import annotations

import pytest

from maxtext.config import from_overrides
from maxtext.errors import ConfigError
from maxtext.models import pipeline, pipeline_specs, specs
from tests import test_pipeline as helpers

HYBRID = "qwen3_next_17"
# A tiny qwen3_next: blocks of 3 Gated DeltaNet + 1 attention layer, every MLP a MoE with a shared expert
# (tests/test_qwen3_next_mesh.py builds it with 4 layers).
TINY_QWEN3_NEXT = dict(
  decoder_block="qwen3_next",
  inhomogeneous_layer_cycle_interval=4,
  base_mlp_dim=48,
  use_qk_norm=True,
  partial_rotary_factor=0.25,
  gdn_conv_kernel_dim=4,
  gdn_key_head_dim=8,
  gdn_value_head_dim=6,
  gdn_num_key_heads=2,
  gdn_num_value_heads=4,
  num_experts=4,
  num_experts_per_tok=2,
  base_moe_mlp_dim=16,
  shared_experts=1,
  norm_topk_prob=True,
  load_balance_loss_weight=0.1,
  logits_via_embedding=False,
)
helpers.MODELS[HYBRID] = dict(TINY_QWEN3_NEXT, base_num_decoder_layers=17)  # 4 blocks and one Gated DeltaNet layer after them
# 2 stages running one block (4 layers) per visit: the circular schedule, 2 repeats over the 4 blocks; the 17th layer
# runs after the pipeline on every stage.
CIRCULAR = dict(
  ici_pipeline_parallelism=2,
  ici_fsdp_parallelism=2,
  ici_tensor_parallelism=2,
  num_layers_per_pipeline_stage=4,
  pipeline_parallel_layers=16,
  num_pipeline_microbatches=4,
)


def test_pipelined_blocks_give_the_unpipelined_loss_and_gradients():
  config = helpers.config_for(HYBRID, **CIRCULAR)
  plan = pipeline_specs.pipeline_plan(config)
  assert (plan.stages, plan.repeats, plan.layers_per_stage, plan.period, plan.remainder) == (2, 2, 1, 4, 1)
  assert pipeline.banner(plan).startswith(
    "pipeline: 16 of 17 layers pipelined (1 after them run on every stage), circular (2 repeats of 1 blocks of 4 layers per stage), 2 stages"
  )
  ref_loss, ref_grads = helpers.reference(HYBRID)
  loss, grads = helpers.loss_and_grads(HYBRID, config)
  assert loss == pytest.approx(ref_loss, rel=1e-5)
  assert grads.keys() == ref_grads.keys()  # the checkpoint's paths: layers/0..3 (block positions) and layers_remainder/0
  assert any(k.startswith("layers/3/") for k in grads) and any(k.startswith("layers_remainder/0/") for k in grads)
  # Measured: every gradient within 2-6e-5 of itself, the loss within 1e-7; a misplaced block or weight would be off
  # by O(1). The spread is this model's float32 reduction order, not the pipeline: the same model unpipelined on
  # another mesh (data 2 x fsdp 2 x tensor 2) differs from the reference by the same 4-5e-5 (largest: the full
  # attention layer's query norm scale, 5.3e-5 on both meshes).
  helpers.assert_gradients_close(grads, ref_grads, rel=1e-4)


@pytest.mark.parametrize(
  "keys, message",
  [
    (  # a stage would run half a block
      dict(ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=2, pipeline_parallel_layers=16),
      "repeats a block of 4 different layers, which each stage runs whole: num_layers_per_pipeline_stage 2 is not a multiple of 4; set it to a multiple of 4",
    ),
    (  # whole blocks left outside the pipeline
      dict(ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=4, pipeline_parallel_layers=8),
      "pipeline_parallel_layers 8 is not their 4 x 4 = 16 layers; set pipeline_parallel_layers=16",
    ),
  ],
  ids=["half-block-per-stage", "blocks-outside"],
)
def test_splits_that_cut_the_blocks_are_config_errors(keys, message):
  config = helpers.config_for(HYBRID, **keys)
  with pytest.raises(ConfigError, match=message) as error:
    specs.model(config)
  assert "\n" not in str(error.value)


def test_blocks_that_do_not_divide_over_the_stages_are_a_config_error():
  """3 blocks (12 layers) per stage visit do not divide the 16 pipelined layers over 2 stages."""
  with pytest.raises(ConfigError, match="pipeline_parallel_layers 16 do not split into 2 stages .* x num_layers_per_pipeline_stage 12 x whole repeats"):
    from_overrides(
      num_devices=8,
      **{**helpers.SMALL, **helpers.MODELS[HYBRID], "ici_pipeline_parallelism": 2, "num_layers_per_pipeline_stage": 12, "pipeline_parallel_layers": 16},
    )
