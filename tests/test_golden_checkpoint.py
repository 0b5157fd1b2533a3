"""Checkpoints written by an earlier version of the code restore into today's model and give the same logits.

tests/data/golden/<name>/ holds a params checkpoint of a tiny model (Orbax, as load_parameters_path reads it) and
<name>_logits.npy the float32 logits that model gave on TOKENS when the checkpoint was written. A change to a
parameter's path, shape or layout fails the restore; a change to the numerics fails the comparison (within
GOLDEN_ATOL: XLA:CPU compiles the same program differently for different CPUs, and the logits then differ in their
last bits, 1-3e-6 measured between two x86 hosts). Refactors of the model code must keep both. Written once with `PYTHONPATH=$PWD python tests/test_golden_checkpoint.py` (on the code
before the model specs); rewrite only for an intended change of the numerics, and say so in the commit.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import models
from maxtext.config import MaxTextConfig, from_overrides
from maxtext.convert import checkpoint_io
from maxtext.train import checkpoint_files
from tests.xla_env import OPTIMISED_COMPILE

DATA = Path(__file__).parent / "data" / "golden"
GOLDEN_ATOL = 2e-5  # logits of order 1; a parameter restored wrong or a changed computation moves them by far more
BASE = dict(num_devices=1, vocab_size=64, base_emb_dim=16, base_num_query_heads=2, base_num_kv_heads=2, head_dim=8, base_mlp_dim=24)
BASE.update(max_target_length=16, dtype="float32", matmul_precision="highest")
MODELS = {
  # GQA with biases, sinks and alternating windows; MoE with a router bias and the clamped SwiGLU; YaRN rope
  "gpt_oss": dict(
    BASE,
    decoder_block="gpt_oss",
    base_num_decoder_layers=2,
    base_moe_mlp_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    sliding_window_size=4,
    attention_bias=True,
    attention_sink=True,
    routed_bias=True,
    mlp_bias=True,
    norm_topk_prob=True,
    mlp_activations=["sigmoid", "linear"],
    mlp_activations_limit=0.5,
    rope_type="yarn",
    rope_factor=4,
    original_max_position_embeddings=4,
    rope_interleave=False,
  ),
  # MLA with low-rank queries; a dense first layer, then sigmoid group-limited routing with a shared expert; gemma-free norms
  "deepseek": dict(
    BASE,
    decoder_block="deepseek",
    base_num_decoder_layers=3,
    base_moe_mlp_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    shared_experts=1,
    first_num_dense_layers=1,
    routed_score_func="sigmoid",
    routed_bias=True,
    routed_scaling_factor=2.5,
    n_routing_groups=4,
    topk_routing_group=2,
    norm_topk_prob=True,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=6,
    rope_type="yarn",
    rope_factor=4,
    original_max_position_embeddings=4,
  ),
  # post-branch norms, (1 + s) scales, scaled embeddings, soft caps, alternating windows, tied embedding
  "gemma2": dict(
    BASE,
    decoder_block="gemma2",
    base_num_decoder_layers=2,
    sliding_window_size=3,
    attn_logits_soft_cap=50.0,
    final_logits_soft_cap=30.0,
    mlp_activations=["gelu", "linear"],
    logits_via_embedding=True,
  ),
}
TOKENS = np.random.default_rng(0).integers(1, 64, size=(2, 8)).astype(np.int32)


def _config(name: str) -> MaxTextConfig:
  return from_overrides(**MODELS[name])


def _logits(model: models.Transformer) -> np.ndarray:
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s: nnx.merge(graphdef, s)(jnp.asarray(TOKENS))).lower(state).compile(OPTIMISED_COMPILE)
  return np.asarray(forward(state))


def _build(config: MaxTextConfig, seed: int) -> models.Transformer:
  """models.build with the initialisation compiled (eager init of many small arrays is slow on CPU)."""
  graphdef = nnx.graphdef(models.abstract_model(config))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.state(models.build(config, nnx.Rngs(seed))))())


def _restored(path: Path, config: MaxTextConfig) -> models.Transformer:
  """The config's model with the checkpoint's parameters, restored as load_parameters_path restores them, on one device."""
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = nnx.state(models.abstract_model(config), nnx.Param)
  target = jax.tree.map(lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one)), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
  model = _build(config, seed=1)  # another seed than the checkpoint's: a parameter the restore missed changes the logits
  nnx.update(model, checkpoint_files.restore_params(str(path.absolute()), target))
  return model


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_restores_to_the_same_logits(name):
  config = _config(name)
  model = _restored(DATA / name, config)
  expected = np.load(DATA / f"{name}_logits.npy")
  got = _logits(model)
  assert got.dtype == expected.dtype and got.shape == expected.shape
  np.testing.assert_allclose(got, expected, rtol=0, atol=GOLDEN_ATOL)


def write() -> None:
  """(Re)write every golden checkpoint and its logits from the current code."""
  DATA.mkdir(parents=True, exist_ok=True)
  for name in MODELS:
    config = _config(name)
    model = _build(config, seed=0)
    shutil.rmtree(DATA / name, ignore_errors=True)
    checkpoint_io.save(DATA / name, model)
    np.save(DATA / f"{name}_logits.npy", _logits(model))


if __name__ == "__main__":
  sys.exit(write())
