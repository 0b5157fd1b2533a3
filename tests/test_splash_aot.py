"""train_compile for a TPU topology from this CPU host lowers splash attention, and it saves memory over XLA attention."""

import importlib.util

import pytest

from maxtext.config import from_overrides

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install 'maxtext[tpu]')")

MODEL = dict(
  compile_topology="v5p-8",
  base_emb_dim=128,
  base_mlp_dim=256,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  head_dim=128,
  base_num_decoder_layers=1,
  vocab_size=512,
  per_device_batch_size=1,
  max_target_length=2048,
)


def test_splash_lowers_for_v5p_and_shrinks_temporaries():
  from maxtext.aot.compile import compile_for_topology

  fused = compile_for_topology(from_overrides(attention="flash", **MODEL))
  xla = compile_for_topology(from_overrides(attention="dot_product", **MODEL))
  assert "tpu_custom_call" in fused.compiled.as_text() and "tpu_custom_call" not in xla.compiled.as_text()
  # [B, H, S, S] float32 scores (16 MiB a layer here) are what the fused kernel never materialises
  assert fused.memory.temp_bytes < xla.memory.temp_bytes / 2
