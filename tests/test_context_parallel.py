"""Context parallelism on 8 simulated CPU devices (float32): losses and gradients equal the model without it, for 2, 4
and 8 context shards, both strategies, with and without load balance, on packed rows, with GQA and a sliding window
(2 shards: the mixtral case of tests/test_pipeline.py, pipelined too), and with DeepSeek Sparse Attention; the chunked kernel and splash (Pallas interpret
mode) over context shards, with attention sinks, equal the XLA reference, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.config.sections import DEFAULT_LOGICAL_AXIS_RULES
from maxtext.errors import ConfigError
from maxtext.layers import attention_ops as ops
from maxtext.layers import context_parallel as cp
from maxtext.layers import mla_sparse
from maxtext.platform import Policy
from tests import test_pipeline as pp
from tests.test_attention_kernels import SCALE, SMALL_BLOCKS, packed_batch

# The pipeline tests' llama model (GQA) and its unpipelined reference, 32 tokens per row, packed rows; the mixtral case
# of tests/test_pipeline.py adds 2 shards, ring, natural order, sliding window, soft cap and experts. The ring merges
# the chunked kernel's blocks; attention=flash puts all_gather on it too.
CASES = [
  ("llama", dict(ici_context_parallelism=4, ici_fsdp_parallelism=2, attention="flash")),
  ("llama", dict(ici_context_parallelism=8, ici_fsdp_parallelism=1, context_parallel_strategy="ring")),
]


def case_id(model: str, keys: dict) -> str:
  balance = "balanced" if keys.get("context_parallel_load_balance", True) else "natural"
  return f"{model}-{keys['ici_context_parallelism']}-{keys.get('context_parallel_strategy', 'all_gather')}-{balance}"


@pytest.mark.parametrize("model,keys", CASES, ids=[case_id(*c) for c in CASES])
def test_context_parallel_loss_and_gradients_equal_unsplit(model, keys):
  ref_loss, ref_grads = pp.reference(model)
  loss, grads = pp.loss_and_grads(model, pp.config_for(model, **keys))
  assert loss == pytest.approx(ref_loss, rel=1e-5)
  pp.assert_gradients_close(grads, ref_grads)


@pytest.mark.parametrize("sparse_training", [True, False], ids=["sparse", "warmup"])
def test_sparse_attention_over_context_shards_equals_unsplit(monkeypatch, sparse_training):
  """DeepSeek Sparse Attention over 4 load-balanced context shards, 3-query blocks (3 per shard, the last padded):
  the loss (with the indexer's KL) and every gradient equal the unsplit model's, in sparse training (the gather path)
  and in the dense warm-up (context-parallel MLA, the KL by blocks); ring is refused."""
  monkeypatch.setattr(mla_sparse, "QUERY_BLOCK", 3)
  keys = dict(indexer_sparse_training=sparse_training)
  ref_loss, ref_grads = pp.loss_and_grads("deepseek_v32", pp.config_for("deepseek_v32", **keys))
  loss, grads = pp.loss_and_grads("deepseek_v32", pp.config_for("deepseek_v32", ici_context_parallelism=4, ici_fsdp_parallelism=2, **keys))
  assert loss == pytest.approx(ref_loss, rel=1e-5)
  pp.assert_gradients_close(grads, ref_grads)
  with pytest.raises(ConfigError, match="set context_parallel_strategy=all_gather"):
    pp.config_for("deepseek_v32", ici_context_parallelism=4, ici_fsdp_parallelism=2, context_parallel_strategy="ring")


def test_dual_chunk_order_balances_causal_work():
  layout = cp.Layout(4, "all_gather", True)
  order = layout.order(16)
  assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
  assert len({int(np.sum(shard + 1)) for shard in order.reshape(4, 4)}) == 1  # keys each shard's queries see
  x = jnp.arange(32).reshape(2, 16)
  np.testing.assert_array_equal(layout.restore(layout.reorder(x)), x)


RULES = [(name, tuple(axes)) for name, axes in DEFAULT_LOGICAL_AXIS_RULES]


SINKS = jnp.asarray([0.7, -0.4, 1.1, 0.2], jnp.float32)  # one sink logit per query head (gpt-oss)
KERNEL_CASES = [("chunked", "all_gather"), ("chunked", "ring"), ("splash", "all_gather"), ("splash", "ring")]


@pytest.mark.parametrize("kernel,strategy", KERNEL_CASES, ids=[f"{k}-{s}" for k, s in KERNEL_CASES])
def test_kernels_with_sinks_over_context_shards_equal_reference(kernel, strategy):
  """Packed rows (load-balanced, but for the chunked all-gather case), GQA (4 query / 2 key heads split over `tensor`), attention sinks (gpt-oss), and for the
  ring a window and a soft cap: the output and the gradients of q, k, v and the sinks equal the XLA reference. The
  chunked kernel runs on 4 context shards; splash (Pallas interpret mode) on 2, per shard with its slice of the mask
  info. The ring merges blocks by log-sum-exp and counts each row's sink once."""
  splash = kernel == "splash"
  shards, seq = (2, 512) if splash else (4, 64)
  window, cap = (37, 5.0) if strategy == "ring" else (0, None)
  q, k, v, seg, pos = packed_batch(batch=2, seq=seq, heads=4, kv_heads=2)
  layout = cp.Layout(shards, strategy, load_balance=splash or strategy == "ring")
  q, k, v, seg, pos = (layout.reorder(x) for x in (q, k, v, seg, pos))
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8 // shards // 2, shards, 2), ("fsdp", "context", "tensor"))
  if splash:
    policy = Policy("tpu", attention="flash", fused_attention="splash", interpret_kernels=True, splash=SMALL_BLOCKS)
  else:
    policy = Policy("cpu", attention="flash", attention_key_block=8)
  kw = dict(q_positions=pos, kv_positions=pos, segment_ids=seg, window=window, soft_cap=cap, scale=SCALE, policy=policy, rules=RULES)
  mask = ops.attention_mask(pos, pos, seg, window)

  def with_grads(fn):  # the output and the gradients of q, k, v and the sinks from one compiled program
    def objective(*args):
      out = fn(*args)
      return jnp.sum(jnp.sin(out)), out

    (_, out), grads = jax.jit(jax.value_and_grad(objective, (0, 1, 2, 3), has_aux=True), compiler_options=pp.FAST_COMPILE)(q, k, v, SINKS)
    return out, grads

  with jax.set_mesh(mesh):
    actual = with_grads(lambda q, k, v, s: ops.attend(q, k, v, **kw, sinks=s, context=layout))
  expected = with_grads(lambda q, k, v, s: ops.xla_attention(q, k, v, mask, SCALE, cap, jax.lax.Precision.HIGHEST, sinks=s))
  assert float(jnp.abs(expected[1][3]).min()) > 1e-3  # the sinks get a gradient
  np.testing.assert_allclose(actual[0], expected[0], atol=2e-5, rtol=0)
  for name, a, e in zip(("q", "k", "v", "sinks"), actual[1], expected[1], strict=True):
    np.testing.assert_allclose(a, e, atol=2e-4 if name == "sinks" else 2e-5, rtol=0, err_msg=f"d{name}")
