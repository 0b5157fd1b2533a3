"""Training choices for a vision tower (use_multimodal, tiny Gemma 3): freeze_vision_encoder_params, the tower's
learning-rate scale, LoRA on the decoder with the tower frozen, and what the FLOP count makes of each."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from maxtext import counting
from maxtext.data import image_text
from maxtext.data.features import IMAGE_KEY
from maxtext.train import setup as setup_lib
from maxtext.train.trainable import in_vision_tower
from tests.test_train_helpers import FAST_COMPILE, mesh_for, tiny_config

IMAGE_ID, TOKENS, SIZE = 127, 4, 8  # an 8 x 8 image in 4 x 4 patches (4 patches), one soft token each
VISION = dict(
  decoder_block="gemma3",
  use_multimodal=True,
  dataset_type="embedded",  # a file dataset: the step takes image chunks (nothing is read here)
  image_size_for_vit=SIZE,
  patch_size_for_vit=4,
  hidden_size_for_vit=16,
  intermediate_size_for_vit=32,
  num_hidden_layers_for_vit=2,
  num_attention_heads_for_vit=2,
  remat_policy_for_vit="none",
  mm_tokens_per_image=TOKENS,
  image_token_id=IMAGE_ID,
  dtype="float32",
  per_device_batch_size=2,
)


def config_for(**overrides):
  return tiny_config(num_devices=1, **{**VISION, **overrides})


def image_batch(config) -> dict[str, np.ndarray]:
  """Two rows of random text, each with one image (its run of placeholders after two tokens) as per-token chunks."""
  rows, length = config.global_batch_size_to_train_on, config.max_target_length
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 100, (rows, length + 1)).astype(np.int32)
  tokens[:, 2 : 2 + TOKENS] = IMAGE_ID
  chunk = image_text.chunk_size(SIZE, TOKENS)
  pixels = np.zeros((rows, length, chunk), np.uint8)
  pixels[:, 2 : 2 + TOKENS] = rng.integers(0, 256, (rows, TOKENS, chunk), dtype=np.uint8)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
  ones = np.ones((rows, length), np.int32)
  return {
    "inputs": tokens[:, :-1],
    "inputs_position": positions,
    "inputs_segmentation": ones,
    "targets": tokens[:, 1:],
    "targets_position": positions,
    "targets_segmentation": ones,
    IMAGE_KEY: pixels,
  }


def flat(params) -> dict[str, np.ndarray]:
  return {"/".join(str(k) for k in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(params)}


def run(config, steps: int = 1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], object]:
  """(initial parameters, parameters after `steps` steps, final train state)."""
  mesh = mesh_for(config)
  setup = setup_lib.build(config, mesh)
  batch = image_batch(config)
  with jax.set_mesh(mesh):
    step = setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile(compiler_options=FAST_COMPILE)
    state = setup.init_state()
    before = flat(jax.device_get(state["params"]))
    for _ in range(steps):
      state, _ = step(state, batch)
    return before, flat(jax.device_get(state["params"])), state


def moved(before, after, prefix: str) -> dict[str, bool]:
  return {k: not np.array_equal(before[k], after[k]) for k in before if k.startswith(prefix)}


@pytest.fixture(scope="module")
def trained():
  return run(config_for())


def test_frozen_tower_is_bit_identical_while_projector_and_decoder_move(trained):
  before, after, state = run(config_for(freeze_vision_encoder_params=True))
  assert moved(before, after, "vision/tower/") and not any(moved(before, after, "vision/tower/").values())
  assert all(moved(before, after, "vision/projector/").values())
  assert any(moved(before, after, "layers/").values()) and any(moved(before, after, "embed/").values())
  # ... and it has no optimizer state, while the unfrozen run's tower has moments.
  frozen_opt = [p for p, _ in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0] if "tower" in jax.tree_util.keystr(p)]
  trained_opt = [p for p, _ in jax.tree_util.tree_flatten_with_path(trained[2]["opt_state"])[0] if "tower" in jax.tree_util.keystr(p)]
  assert not frozen_opt and trained_opt
  assert any(moved(trained[0], trained[1], "vision/tower/").values())  # the same run unfrozen trains the tower


def test_learning_rate_scale_moves_the_tower_by_the_scale(trained):
  plain_before, plain_after, _ = trained
  before, after, _ = run(config_for(vision_learning_rate_scale=0.25))
  for name in before:
    delta, plain = after[name] - before[name], plain_after[name] - plain_before[name]
    np.testing.assert_array_equal(before[name], plain_before[name])
    if name.startswith("vision/tower/"):
      np.testing.assert_allclose(delta, 0.25 * plain, rtol=1e-4, atol=1e-7, err_msg=name)
      assert np.abs(plain).max() > 0
    else:
      np.testing.assert_allclose(delta, plain, rtol=1e-4, atol=1e-7, err_msg=name)


def test_lora_on_the_decoder_leaves_the_tower_and_base_unchanged():
  before, after, _ = run(config_for(**{"lora.enable_lora": True, "lora.lora_rank": 2}))
  adapters = {k: v for k, v in moved(before, after, "").items() if "lora" in k}
  assert adapters and any(adapters.values())
  assert not any(v for k, v in moved(before, after, "").items() if "lora" not in k)


def _tower_sizes(config) -> dict[str, int]:
  """Entries of each tower part by hand: patch embedding, blocks (all layers), post norm; projector."""
  e, m, layers, p, c = config.hidden_size_for_vit, config.intermediate_size_for_vit, config.num_hidden_layers_for_vit, config.patch_size_for_vit, 3
  block = 2 * 2 * e + 4 * (e * e + e) + (e * m + m) + (m * e + e)  # two layer norms, q/k/v/o with biases, the MLP
  return {"patch": p * p * c * e + e, "blocks": layers * block, "post": 2 * e, "projector": e + e * config.emb_dim}


def test_flops_leave_out_the_frozen_towers_gradients():
  """The tower's weight and input gradients and its backward attention scores are exactly the difference."""
  trained, frozen = config_for(), config_for(freeze_vision_encoder_params=True)
  sizes, patches = _tower_sizes(trained), (SIZE // 4) ** 2
  images = trained.global_batch_size_to_train_on * (trained.max_target_length // TOKENS)
  scores = trained.num_hidden_layers_for_vit * 4 * patches**2 * trained.hidden_size_for_vit
  weight_grads = 2 * patches * (sizes["patch"] + sizes["blocks"] + sizes["post"])
  input_grads = 2 * patches * (sizes["blocks"] + sizes["post"]) + 2 * TOKENS * sizes["projector"]  # the patch embedding's input is pixels
  expected = images * (weight_grads + input_grads + 2 * scores)
  difference = counting.training_flops_per_step(trained) - counting.training_flops_per_step(frozen)
  assert math.isclose(difference, expected, rel_tol=1e-12), (difference, expected)
  # A forward pass is the same either way, and the tower runs once per image slot, not per text token.
  vision_forward = images * (2 * patches * (sizes["patch"] + sizes["blocks"] + sizes["post"]) + 2 * TOKENS * sizes["projector"] + scores)
  text_only = config_for(use_multimodal=False, dataset_type="synthetic")
  assert counting.forward_flops_per_step(trained) == counting.forward_flops_per_step(frozen)
  assert math.isclose(counting.forward_flops_per_step(trained) - counting.forward_flops_per_step(text_only), vision_forward, rel_tol=1e-12)


def test_tower_filter_names_only_tower_paths():
  assert in_vision_tower(("vision", "tower", "blocks")) and not in_vision_tower(("vision", "projector")) and not in_vision_tower(("layers", "tower"))
