"""Shared tiny configs for the training tests (no tests here)."""

import jax

from maxtext import mesh as mesh_lib
from maxtext.config import from_overrides

# The tiny model and synthetic data every training test shares (also as command-line key=value pairs).
# compiler_options for tests' own programs: the same HLO with XLA's backend optimisations off, about 2/3 of the compile time
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


TINY_MODEL = dict(
  base_emb_dim=32,
  base_num_query_heads=2,
  base_num_kv_heads=2,
  head_dim=16,
  base_mlp_dim=64,
  base_num_decoder_layers=2,
  vocab_size=128,
  max_target_length=16,
  per_device_batch_size=1,
  dataset_type="synthetic",
)
TINY = dict(
  **TINY_MODEL,
  learning_rate=1e-2,
  warmup_steps_fraction=0.0,
  enable_tensorboard=False,
  device_peak_tflops=1.0,
  async_checkpointing=False,
)


def tiny_config(num_devices: int = 8, **overrides):
  return from_overrides(num_devices=num_devices, **{**TINY, **overrides})


def mesh_for(config):
  return mesh_lib.create(config, jax.devices()[: config.num_devices])
