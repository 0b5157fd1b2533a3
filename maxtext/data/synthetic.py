"""Synthetic batches: deterministic from the step index, generated on device, already sharded.

Each row is an arithmetic progression modulo vocab_size with a random start and
stride, so a model can learn it (the loss falls) while resume stays exact: batch
k depends only on (data_shuffle_seed, split, k).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from maxtext import mesh as mesh_lib
from maxtext.config import MaxTextConfig
from maxtext.data.batch_size import batch_rows

BATCH_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position", "targets_segmentation")
MAX_STRIDE = 8


def _make_batch(key: jax.Array, rows: int, length: int, vocab: int) -> dict[str, jax.Array]:
  k_start, k_stride = jax.random.split(key)
  start = jax.random.randint(k_start, (rows, 1), 0, vocab, jnp.int32)
  stride = jax.random.randint(k_stride, (rows, 1), 1, MAX_STRIDE, jnp.int32)
  t = jnp.arange(length + 1, dtype=jnp.int32)[None, :]
  tokens = (start + stride * t) % vocab
  positions = jnp.broadcast_to(t[:, :length], (rows, length))
  ones = jnp.ones((rows, length), jnp.int32)
  return {
    "inputs": tokens[:, :-1],
    "inputs_position": positions,
    "inputs_segmentation": ones,
    "targets": tokens[:, 1:],
    "targets_position": positions,
    "targets_segmentation": ones,
  }


class SyntheticIterator:
  """Endless iterator of global batches {key: int32 [rows, max_target_length]}: global_batch_size_to_train_on rows, or
  global_batch_size_to_eval_on for the eval split."""

  def __init__(self, config: MaxTextConfig, mesh: Mesh, split: str = "train"):
    self.step = 0
    rows, length, vocab = batch_rows(config, split), config.max_target_length, config.vocab_size
    base = jax.random.fold_in(jax.random.key(config.data_shuffle_seed), 0 if split == "train" else 1)
    sharding = mesh_lib.data_sharding(config, mesh)
    shardings = {k: sharding for k in BATCH_KEYS}
    self._generate = jax.jit(lambda step: _make_batch(jax.random.fold_in(base, step), rows, length, vocab), out_shardings=shardings)

  def __iter__(self) -> SyntheticIterator:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    batch = self._generate(np.int32(self.step))
    self.step += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"step": self.step}

  def set_state(self, state: dict[str, Any]) -> None:
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or len(state) != 1:
      raise ValueError(f"not a synthetic data-iterator state: {str(state)[:100]}")
    self.step = step
