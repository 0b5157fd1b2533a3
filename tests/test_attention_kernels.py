"""Every attention kernel equals the XLA reference (forward and gradients) with packed segments, windows, GQA and
soft caps; kernel selection per platform policy; cuDNN's mask/offset construction; models built with accelerator
policies (splash in Pallas interpret mode) on CPU."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext import models, platform
from maxtext.config import ConfigError, from_overrides
from maxtext.layers import attention_ops as ops
from maxtext.platform import FUSED_ATTENTION, Policy, SplashBlocks

SCALE = 0.3
SMALL_BLOCKS = SplashBlocks(128, 128, 128, 128, 128, 128, 128, 128)


def packed_batch(batch: int = 2, seq: int = 128, heads: int = 2, kv_heads: int = 1, head_dim: int = 8, seed: int = 0):
  """q/k/v and rows of three documents of random lengths followed by padding (segment 0), positions restarting per document."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
  segments, positions = np.zeros((batch, seq), np.int32), np.zeros((batch, seq), np.int32)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(5, seq - 20), 2, replace=False))
    ids = np.searchsorted(cuts, np.arange(seq), side="right") + 1
    ids[seq - 7 :] = 0  # padding
    segments[row] = ids
    positions[row] = np.arange(seq) - np.array([np.argmax(ids == i) for i in ids])
  return q, k, v, jnp.asarray(segments), jnp.asarray(positions)


@pytest.fixture(scope="module")
def batch():
  return packed_batch()


_REFERENCES: dict = {}


def expected_for(batch, window, cap):
  """The XLA reference's output and gradients, computed once per (window, cap)."""
  if (window, cap) not in _REFERENCES:
    q, k, v, seg, pos = batch
    _REFERENCES[window, cap] = forward_and_grads(jax.jit(lambda q, k, v: reference(q, k, v, seg, pos, window, cap)), q, k, v)
  return _REFERENCES[window, cap]


def reference(q, k, v, segments, positions, window, cap):
  return ops.xla_attention(q, k, v, ops.attention_mask(positions, positions, segments, window), SCALE, cap, jax.lax.Precision.HIGHEST)


def forward_and_grads(fn, q, k, v):
  """(output, d/d(q,k,v) of sum(sin(output))): a cotangent that differs per element."""
  out = fn(q, k, v)
  grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), (0, 1, 2))(q, k, v)
  return out, grads


def assert_same(actual, expected, atol=2e-5):
  (out_a, grads_a), (out_e, grads_e) = actual, expected
  np.testing.assert_allclose(out_a, out_e, atol=atol, rtol=0)
  for name, a, e in zip("qkv", grads_a, grads_e):
    np.testing.assert_allclose(a, e, atol=atol, rtol=0, err_msg=f"d{name}")


CASES = [(0, None), (37, None), (0, 5.0), (64, 3.0)]


@pytest.mark.parametrize("window, cap", CASES)
def test_chunked_equals_reference(batch, window, cap):
  q, k, v, seg, pos = batch
  expected = expected_for(batch, window, cap)
  # a block that does not divide the length exercises the padded last block
  actual = forward_and_grads(jax.jit(lambda q, k, v: ops.chunked_attention(q, k, v, pos, pos, seg, window, SCALE, cap, 48)), q, k, v)
  assert_same(actual, expected)


@pytest.mark.parametrize("window, cap", [(0, None), (64, 3.0)])
def test_splash_interpret_equals_reference(batch, window, cap):
  q, k, v, seg, pos = batch
  expected = expected_for(batch, window, cap)
  run = lambda q, k, v: ops.splash_attention(q, k, v, seg, window=window, scale=SCALE, soft_cap=cap, blocks=SMALL_BLOCKS, interpret=True)  # noqa: E731
  assert_same(forward_and_grads(run, q, k, v), expected)


SINKS = jnp.asarray([0.7, -0.4], jnp.float32)  # one sink logit per query head (gpt-oss)


def test_sinks_in_chunked_and_splash_equal_reference(batch):
  """Sinks join every softmax row in the XLA reference, the chunked kernel (its hand-written backward gives the sinks'
  gradient too) and splash (interpret mode): outputs and gradients for q, k, v and the sinks agree."""
  q, k, v, seg, pos = batch
  window = 37

  def with_grads(fn):
    out = fn(q, k, v, SINKS)
    return out, jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), (0, 1, 2, 3))(q, k, v, SINKS)

  mask = ops.attention_mask(pos, pos, seg, window)
  ref = with_grads(jax.jit(lambda q, k, v, s: ops.xla_attention(q, k, v, mask, SCALE, None, jax.lax.Precision.HIGHEST, sinks=s)))
  chunked = with_grads(jax.jit(lambda q, k, v, s: ops.chunked_attention(q, k, v, pos, pos, seg, window, SCALE, None, 48, s)))
  splash = with_grads(lambda q, k, v, s: ops.splash_attention(q, k, v, seg, s, window=window, scale=SCALE, soft_cap=None, blocks=SMALL_BLOCKS, interpret=True))
  assert float(jnp.abs(ref[0] - expected_for(batch, window, None)[0]).max()) > 0.05  # the sinks change the output
  assert float(jnp.abs(ref[1][3]).min()) > 1e-3  # and get a gradient
  for actual in (chunked, splash):
    np.testing.assert_allclose(actual[0], ref[0], atol=2e-5, rtol=0)
    for name, a, e in zip(("q", "k", "v", "sinks"), actual[1], ref[1]):
      np.testing.assert_allclose(a, e, atol=2e-4 if name == "sinks" else 2e-5, rtol=0, err_msg=f"d{name}")


def test_sinks_fall_back_from_cudnn_with_a_logged_reason(caplog):
  ops._logged.clear()
  with caplog.at_level(logging.WARNING, logger="maxtext.attention"):
    assert ops.select(policy("gpu"), **FACTS, sinks=True) == "xla"
  assert any("(cuDNN attention has no attention sinks); falling back to XLA" in r.getMessage() for r in caplog.records)
  assert ops.select(policy("tpu"), **FACTS, sinks=True) == "splash"
  with pytest.raises(ConfigError, match="attention=cudnn cannot run this model: cuDNN attention has no attention sinks"):
    ops.select(policy("gpu", attention="cudnn"), **FACTS, sinks=True)


def test_attend_with_narrower_values_pads_them_for_fused_kernels(batch):
  """MLA's values are narrower than its queries and keys: attend pads them for a fused kernel and cuts the output."""
  q, k, v, seg, pos = batch
  v = v[..., :5]
  kw = dict(q_positions=pos, kv_positions=pos, segment_ids=seg, window=37, soft_cap=None, scale=SCALE, precision=jax.lax.Precision.HIGHEST)
  expected = forward_and_grads(jax.jit(lambda q, k, v: ops.attend(q, k, v, policy=policy("cpu", "dot_product"), **kw)), q, k, v)
  actual = forward_and_grads(jax.jit(lambda q, k, v: ops.attend(q, k, v, policy=policy("cpu", "flash", attention_key_block=48), **kw)), q, k, v)
  assert actual[0].shape == q.shape[:3] + (5,)
  assert_same(actual, expected)


@pytest.mark.parametrize("window", [37])
def test_cudnn_segment_mask_path_equals_reference(batch, window):
  """The cuDNN call with the segment mask, run by jax.nn.dot_product_attention's XLA implementation on CPU."""
  q, k, v, seg, pos = batch
  expected = expected_for(batch, window, None)
  run = lambda q, k, v: ops.cudnn_attention(q, k, v, seg, window=window, scale=SCALE, max_segments=0, implementation="xla")  # noqa: E731
  assert_same(forward_and_grads(run, q, k, v), expected)


def test_packed_offsets_hand_example():
  segments = jnp.asarray([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
  offsets, lengths = ops.packed_offsets(segments, 3)
  np.testing.assert_array_equal(offsets, [[0, 2, 5, -1], [0, -1, -1, -1]])
  np.testing.assert_array_equal(lengths, [[2, 3, 1], [6, -1, -1]])


def test_packed_offsets_mask_equals_segment_causal_mask(batch):
  _, _, _, seg, pos = batch
  offsets, lengths = ops.packed_offsets(seg, 4)  # three documents + padding
  np.testing.assert_array_equal(ops.offsets_mask(offsets, lengths, seg.shape[1]), ops.attention_mask(pos, pos, seg, 0)[:, 0, 0])


def policy(platform_name, attention="autoselected", **kw):
  return Policy(platform=platform_name, attention=attention, fused_attention=FUSED_ATTENTION[platform_name], **kw)


FACTS = dict(dtype=jnp.bfloat16, head_dim=64, q_len=2048, kv_len=2048, soft_cap=None)


def test_autoselected_picks_the_platform_kernel():
  assert ops.select(policy("tpu"), **FACTS) == "splash"
  assert ops.select(policy("gpu"), **FACTS) == "cudnn"
  assert ops.select(policy("cpu", chunked_attention_from=2048), **FACTS) == "chunked"
  assert ops.select(policy("cpu", chunked_attention_from=2048), **{**FACTS, "q_len": 1024, "kv_len": 1024}) == "xla"
  assert ops.select(policy("tpu", attention="dot_product"), **FACTS) == "xla"
  assert ops.select(policy("cpu", attention="flash"), **FACTS) == "chunked"
  assert ops.select(policy("tpu"), **{**FACTS, "soft_cap": 30.0}) == "splash"  # splash caps logits itself


def test_autoselected_fallback_is_logged_once(caplog):
  ops._logged.clear()
  with caplog.at_level(logging.WARNING, logger="maxtext.attention"):
    for _ in range(3):
      assert ops.select(policy("gpu"), **{**FACTS, "soft_cap": 30.0}) == "xla"
  lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
  assert len(lines) == 1 and "soft cap" in lines[0]


@pytest.mark.parametrize(
  "request_, platform_name, facts, fragment",
  [
    ("cudnn", "cpu", {}, "needs a GPU"),
    ("cudnn", "gpu", {"soft_cap": 30.0}, "no logit soft cap"),
    ("cudnn", "gpu", {"dtype": jnp.float32}, "bfloat16 or float16"),
    ("flash", "tpu", {"q_len": 100, "kv_len": 100}, "divisible by 128"),
    ("flash", "gpu", {"head_dim": 256}, "head_dim"),
  ],
)
def test_explicit_kernel_that_cannot_run_is_a_config_error(request_, platform_name, facts, fragment):
  with pytest.raises(ConfigError, match=fragment):
    ops.select(policy(platform_name, attention=request_), **{**FACTS, **facts})


def test_explicit_cudnn_on_cpu_fails_when_the_model_is_built():
  config = from_overrides(num_devices=1, attention="cudnn", base_emb_dim=32, base_num_decoder_layers=1, head_dim=8, vocab_size=64)
  with pytest.raises(ConfigError, match="attention=cudnn cannot run this model: cuDNN attention needs a GPU"):
    models.abstract_model(config, platform.for_platform(config, "cpu"))


MODEL = dict(
  base_emb_dim=16,
  base_num_query_heads=2,
  base_num_kv_heads=1,
  base_mlp_dim=32,
  base_num_decoder_layers=2,
  head_dim=8,
  vocab_size=64,
  dtype="float32",
  matmul_precision="highest",
  max_target_length=128,
  sa_block_q=128,
  sa_block_kv=128,
  sa_block_kv_compute=128,
  sa_block_q_dkv=128,
  sa_block_kv_dkv=128,
  sa_block_kv_dkv_compute=128,
  sa_block_q_dq=128,
  sa_block_kv_dq=128,
)


@pytest.mark.parametrize("family, extra", [("llama2", dict(base_num_decoder_layers=1)), ("gemma2", dict(sliding_window_size=24, attn_logits_soft_cap=20.0))])
def test_model_with_tpu_policy_matches_cpu_policy(batch, family, extra):
  """A model built with the TPU policy runs splash (interpret mode) in every layer; gemma2's scanned layers alternate
  a local and a global window, one kernel each (the scan steps over (local, global) pairs)."""
  _, _, _, seg, pos = batch
  config = from_overrides(num_devices=1, decoder_block=family, **{**MODEL, **extra})
  tokens = jnp.asarray(np.random.default_rng(1).integers(1, 64, size=seg.shape), jnp.int32)
  cpu = models.build(config, policy=platform.for_platform(config, "cpu"))
  tpu = models.build(config, policy=platform.for_platform(config, "tpu", interpret=True))
  expected = jax.jit(lambda t: cpu(t, pos, seg))(tokens)
  actual = jax.jit(lambda t: tpu(t, pos, seg))(tokens)
  np.testing.assert_allclose(actual, expected, atol=2e-4 * float(jnp.abs(expected).max()), rtol=0)


def test_policies_per_platform():
  config = from_overrides(num_devices=1, attention="flash", sa_block_q=256, max_segments_per_seq=8)
  cpu, gpu, tpu = (platform.for_platform(config, p) for p in ("cpu", "gpu", "tpu"))
  assert cpu.integer_bf16_rounding and cpu.tune_host_allocator and cpu.chunked_attention_from > 0
  assert not (gpu.integer_bf16_rounding or gpu.tune_host_allocator or tpu.integer_bf16_rounding or tpu.chunked_attention_from)
  assert tpu.attention == "flash" and tpu.splash.block_q == 256 and gpu.max_segments_per_seq == 8
  assert tpu.host_offload and not (cpu.host_offload or gpu.host_offload)  # where decoder_layer_input=auto may offload
  assert not tpu.offload_layer_inputs  # decoder_layer_input=auto, unresolved: the inputs stay in HBM
  assert platform.for_platform(from_overrides(num_devices=1, decoder_layer_input="offload"), "cpu").offload_layer_inputs
  assert (
    tpu.compiler_state_layouts and not platform.for_platform(from_overrides(num_devices=1, optimizer_memory_host_offload=True), "tpu").compiler_state_layouts
  )
  assert platform.resolve(config).platform == "cpu"  # the tests' devices
  assert platform.predict(config, platforms="cuda") == "gpu" and platform.predict(config, platforms="", accelerator_nodes=True) == "tpu"
  assert platform.predict(from_overrides(num_devices=1, hardware="gpu_multiprocess"), platforms="cpu") == "gpu"


def test_remat_auto_binary_search_picks_least_recomputation_that_fits():
  from maxtext.aot import remat_auto

  sizes = dict(zip(remat_auto.CANDIDATES, (100, 80, 70, 60, 50, 40)))  # memory falls along the candidates
  config = from_overrides(num_devices=1, remat_policy="auto")
  compiled = []

  def fake(c):
    compiled.append(c.remat_policy)
    return sizes[c.remat_policy] if c.remat_policy != "none" else None  # 'none': XLA runs out of memory

  choice = remat_auto.choose(config, 70, fake, offload_possible=False)  # budget 63 with the 10% margin
  assert choice.policy == "save_dot_except_mlp" and len(compiled) <= 3 and "save_dot_except_mlp" in choice.line()
  assert remat_auto.choose(config, 10, fake, offload_possible=False).policy == "full"  # nothing fits: full, and the caller reports it
  assert remat_auto.choose(config, 1000, fake, offload_possible=False).policy == "minimal"


def test_auto_offloads_layer_inputs_only_when_the_step_does_not_fit_otherwise():
  """decoder_layer_input=auto: layer inputs in HBM when that fits, offloaded when only that fits; with remat_policy=auto
  the least recomputation first, then the least host traffic."""
  from maxtext.aot import remat_auto

  device = dict(zip(remat_auto.CANDIDATES, (100, 80, 70, 60, 50, 40)))
  compiled = []

  def fake(c):
    compiled.append((c.remat_policy, c.decoder_layer_input))
    return device[c.remat_policy] - (15 if c.decoder_layer_input == "offload" else 0)

  full = from_overrides(num_devices=1)  # remat_policy=full, decoder_layer_input=auto
  choice = remat_auto.choose(full, 50, fake, offload_possible=True)  # budget 45: full fits in HBM
  assert (choice.policy, choice.layer_input, compiled) == ("full", "device", [("full", "device")])
  assert "fits with them in HBM" in choice.reason() and "compiled: full/device" in choice.line()
  compiled.clear()
  choice = remat_auto.choose(full, 40, fake, offload_possible=True)  # budget 36: only offloaded
  assert (choice.policy, choice.layer_input, compiled) == ("full", "offload", [("full", "device"), ("full", "offload")])
  assert "does not fit with them in HBM" in choice.reason()
  compiled.clear()
  assert remat_auto.choose(full, 40, fake, offload_possible=False).layer_input == "device" and compiled == []  # CPU, GPU: nothing to decide

  both = full.model_copy(update={"remat_policy": "auto"})
  choice = remat_auto.choose(both, 70, fake, offload_possible=True)  # budget 63: save_dot_except_mlp on device, or one policy earlier offloaded
  assert (choice.policy, choice.layer_input) == ("save_dot_except_mlpwi", "offload")
  assert ("none", "offload") not in compiled  # remat_policy=none saves no layer input
  line = choice.line()
  assert line.startswith("remat_policy=auto and decoder_layer_input=auto chose remat_policy=save_dot_except_mlpwi")
  assert "pinned host memory" in line and "the least recomputation that fits" in line


def test_remat_auto_resolves_from_compiled_memory_and_logs():
  from maxtext import mesh as mesh_lib
  from maxtext.aot import remat_auto
  from maxtext.train import setup as setup_lib

  config = from_overrides(num_devices=1, remat_policy="auto", **{**MODEL, "max_target_length": 16, "base_num_decoder_layers": 1})
  mesh = mesh_lib.create(config, jax.devices()[:1])
  lines = []
  resolved, choice = remat_auto.resolve(config, mesh, setup_lib.build, hbm_bytes=1024, log=lines.append)  # nothing fits in 1 KiB: two compiles, then full
  assert resolved.remat_policy == "full" and resolved.decoder_layer_input == "device" and len(lines) == 1 and not choice.fits
  assert lines[0].startswith("remat_policy=auto and decoder_layer_input=auto chose remat_policy=full") and "no policy that saves more fits" in lines[0]
  assert "save_dot_except_mlpwi/device" in lines[0] and "save_qkv_proj/device" in lines[0]
  assert remat_auto.resolve(resolved, mesh, setup_lib.build) == (resolved, None)  # named values stay


def test_queries_against_a_longer_cache_run_xla_under_every_request():
  for request in ("autoselected", "flash", "cudnn"):
    assert ops.select(policy("gpu", attention=request), **{**FACTS, "q_len": 1}) == "xla"
