"""Decoding on a mesh whose devices are not where the parameters live (e.g. a model loaded on the GPU decoded on the
CPU backend, as benchmarks/gpu_suite.py's decode check does): simulated here with two single-device CPU meshes."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from maxtext import mesh as mesh_lib
from maxtext import models
from maxtext.config import from_overrides
from maxtext.inference.generate import Generator
from maxtext.inference.loading import load_model
from maxtext.train.checkpoint_files import save_params

TINY = dict(
  base_emb_dim=32,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  head_dim=8,
  base_mlp_dim=48,
  base_num_decoder_layers=2,
  vocab_size=97,
  dtype="float32",
  matmul_precision="highest",
  max_target_length=24,
  max_prefill_predict_length=16,
  num_devices=1,
)
PROMPTS = [[5, 6, 7, 8], [9, 10]]


def devices_of(state) -> set:
  return {d for a in jax.tree.leaves(state) for d in a.sharding.device_set}


def test_generator_moves_a_state_from_other_devices_onto_its_mesh():
  config = from_overrides(**TINY)
  first, second = jax.devices()[:2]
  model = models.create_sharded(config, mesh_lib.create(config, [first]))
  want = Generator(model, config=config, max_target_length=20).generate(PROMPTS).tokens
  other = mesh_lib.create(config, [second])
  gen = Generator(model, config=config, max_target_length=20, mesh=other)
  assert devices_of(gen.state) == {second}
  assert gen.generate(PROMPTS).tokens == want


def test_load_model_restores_onto_the_given_mesh(tmp_path):
  config = from_overrides(**TINY)
  model = models.create_sharded(config, mesh_lib.create(config, [jax.devices()[0]]))
  save_params(str(tmp_path / "params"), nnx.state(model, nnx.Param))
  loaded_config = from_overrides(**TINY, load_parameters_path=str(tmp_path / "params"))
  mesh = mesh_lib.create(loaded_config, [jax.devices()[1]])
  loaded = load_model(loaded_config, mesh, lambda message: None)
  assert devices_of(nnx.state(loaded, nnx.Param)) == {jax.devices()[1]}
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)), nnx.to_flat_state(nnx.state(loaded, nnx.Param)), strict=True):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
