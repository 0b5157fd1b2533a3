"""train_compile for a TPU topology from this CPU host: a scanned group of layers of different structures (Gemma 4's
sliding and global layers) runs its layers' backward passes one after the other, not interleaved."""

import importlib.util

import pytest

from maxtext.config import from_overrides

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install 'maxtext[tpu]')")

SEQ, MLP = 1024, 4096
MODEL = dict(
  model_name="gemma4-31b",
  override_model_config=True,
  compile_topology="v5p-8",
  base_emb_dim=256,
  base_mlp_dim=MLP,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  head_dim=128,
  global_head_dim=256,
  global_num_kv_heads=1,
  base_num_decoder_layers=6,
  inhomogeneous_layer_cycle_interval=3,  # two scanned groups of two sliding layers and a global one
  sliding_window_size=256,
  vocab_size=512,
  per_device_batch_size=1,
  max_target_length=SEQ,
)


def test_grouped_layers_are_recomputed_one_at_a_time(monkeypatch):
  """remat.sequential_backward on each layer of the group: without it XLA recomputes the layers early and postpones
  their weight-gradient matmuls to the end of the group's backward pass, keeping the three layers' MLP activations
  ([B, S, mlp] each, several per layer) alive together; with it the temporaries fall by more than three such
  activations (gemma4-31b on v5p-32: 5.1 GB per device; docs/tpu.md)."""
  from maxtext.aot.compile import compile_for_topology
  from maxtext.models import remat

  ordered = compile_for_topology(from_overrides(**MODEL)).memory.temp_bytes
  monkeypatch.setattr(remat, "sequential_backward", lambda fn: fn)
  together = compile_for_topology(from_overrides(**MODEL)).memory.temp_bytes
  activation = 1 * SEQ * MLP * 2  # bfloat16
  assert ordered < together - 3 * activation, (ordered, together)  # 5.5 of them measured
