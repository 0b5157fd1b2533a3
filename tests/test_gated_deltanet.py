"""Qwen3-Next's layer kinds against transformers (PyTorch CPU, float32, the torch fallback kernels): the Gated DeltaNet
linear attention (maxtext.layers.gated_deltanet) and the gated full attention (maxtext.layers.attention with
output_gate, partial rotary and zero-centred QK norms); the chunked form against the recurrent one, prefill then
decode against one forward, and packed documents against each document alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.layers.attention import Attention, AttentionSpec
from maxtext.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetSpec, chunked_delta_rule, document_index, l2_normalize, recurrent_delta_rule
from maxtext.layers.norms import NormSpec
from maxtext.layers.rope import RopeSpec
from maxtext.platform import DTYPES, Dtypes, Policy

torch = pytest.importorskip("torch")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

F32 = DTYPES["float32"]
POLICY = Policy("cpu", attention="dot_product", dtypes=Dtypes(params=F32, compute=F32, precision=jax.lax.Precision.HIGHEST))
EMB, SEQ, CHUNK = 32, 150, 64  # 150 tokens: more than two chunks of 64, not a multiple of it
HF_ATOL, FORMS_ATOL = 1e-4, 1e-5  # against transformers; between our chunked and recurrent forms (float32)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4)
FULL = dict(
  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}
)


def hf_config():
  config = qwen3_next.Qwen3NextConfig(hidden_size=EMB, num_hidden_layers=4, rms_norm_eps=1e-6, **LINEAR, **FULL)
  config._attn_implementation = "eager"
  return config


def _perturb(module, seed: int) -> None:
  """Every parameter away from its init (norm weights, A_log and dt_bias included)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in module.parameters():
      p.add_(0.3 * torch.randn(p.shape, generator=gen))


def _t(x) -> np.ndarray:
  return x.detach().numpy()


# Compiled once per shape (op-by-op dispatch of the layer costs far more on the test machine).
forward = nnx.jit(lambda m, x, seg: m.prefill(x, seg))
step = nnx.jit(lambda m, x, state: m.decode_step(x, state))


def gdn_spec(chunk: int = CHUNK) -> GatedDeltaNetSpec:
  return GatedDeltaNetSpec(emb_dim=EMB, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4, chunk_size=chunk)


def gdn_from_torch(hf, spec: GatedDeltaNetSpec) -> GatedDeltaNet:
  """Hugging Face's Qwen3NextGatedDeltaNet weights in our layout (the converter's reshapes)."""
  layer = GatedDeltaNet(spec, policy=POLICY, rngs=nnx.Rngs(0))
  hk, hv, dv = spec.num_key_heads, spec.num_value_heads, spec.value_head_dim
  layer.in_proj_qkvz.kernel[...] = jnp.asarray(_t(hf.in_proj_qkvz.weight).T.reshape(EMB, hk, -1))
  layer.in_proj_ba.kernel[...] = jnp.asarray(_t(hf.in_proj_ba.weight).T.reshape(EMB, hk, -1))
  layer.conv[...] = jnp.asarray(_t(hf.conv1d.weight)[:, 0, :].T)
  layer.A_log[...] = jnp.asarray(_t(hf.A_log))
  layer.dt_bias[...] = jnp.asarray(_t(hf.dt_bias))
  layer.norm.scale[...] = jnp.asarray(_t(hf.norm.weight))
  layer.out_proj.kernel[...] = jnp.asarray(_t(hf.out_proj.weight).T.reshape(hv, dv, EMB))
  return layer


@pytest.fixture(scope="module")
def gdn():
  """(torch layer, our layer, inputs [2, SEQ, EMB]) with the same perturbed weights."""
  torch.manual_seed(0)
  hf = qwen3_next.Qwen3NextGatedDeltaNet(hf_config(), layer_idx=0).float().eval()
  _perturb(hf, 1)
  with torch.no_grad():  # decays between 0.99 and 0.7 per token (times softplus ~ 1): the state reaches across chunks
    hf.A_log.copy_(torch.log(torch.linspace(0.01, 0.3, hf.A_log.shape[0])))
  x = np.random.default_rng(0).normal(size=(2, SEQ, EMB)).astype(np.float32)
  return hf, gdn_from_torch(hf, gdn_spec()), x


def test_gated_deltanet_matches_transformers(gdn):
  hf, layer, x = gdn
  with torch.no_grad():
    ref = _t(hf(torch.from_numpy(x)))
  ours = np.asarray(forward(layer, jnp.asarray(x), None)[0])
  assert ours.shape == ref.shape == (2, SEQ, EMB)
  np.testing.assert_allclose(ours, ref, atol=HF_ATOL, rtol=0)


def test_chunked_form_equals_recurrent_form(gdn):
  _, layer, x = gdn
  chunked = np.asarray(forward(layer, jnp.asarray(x), None)[0])
  recurrent, _ = step(layer, jnp.asarray(x), layer.init_state(2))
  np.testing.assert_allclose(chunked, np.asarray(recurrent), atol=FORMS_ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [CHUNK, 16])
def test_chunked_delta_rule_equals_recurrent_rule(chunk):
  """Outputs and final state, with documents starting inside and on chunk boundaries and an incoming state."""
  rng = np.random.default_rng(3)
  b, s, h, dk, dv = 2, SEQ, 4, 8, 6
  q = l2_normalize(jnp.asarray(rng.normal(size=(b, s, h, dk)), jnp.float32)) * dk**-0.5
  k = l2_normalize(jnp.asarray(rng.normal(size=(b, s, h, dk)), jnp.float32))
  v = jnp.asarray(rng.normal(size=(b, s, h, dv)), jnp.float32)
  g = -jnp.asarray(rng.exponential(0.3, size=(b, s, h)), jnp.float32)
  beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(b, s, h)), jnp.float32))
  doc = document_index(jnp.asarray(np.stack([_segments(row) for row in PACKED])), b, s)
  initial = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
  hp = jax.lax.Precision.HIGHEST
  o_chunked, s_chunked = jax.jit(chunked_delta_rule, static_argnums=(6, 8))(q, k, v, g, beta, doc, chunk, initial, hp)
  o_recurrent, s_recurrent = jax.jit(recurrent_delta_rule, static_argnums=7)(q, k, v, g, beta, doc, initial, hp)
  np.testing.assert_allclose(np.asarray(o_chunked), np.asarray(o_recurrent), atol=FORMS_ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(s_chunked), np.asarray(s_recurrent), atol=FORMS_ATOL, rtol=0)


def test_prefill_then_decode_steps_equal_one_forward(gdn):
  _, layer, x = gdn
  prompt, steps = 131, 6
  full = np.asarray(forward(layer, jnp.asarray(x), None)[0])
  y, state = forward(layer, jnp.asarray(x[:, :prompt]), None)
  np.testing.assert_allclose(np.asarray(y), full[:, :prompt], atol=FORMS_ATOL, rtol=0)
  for t in range(prompt, prompt + steps):
    y, state = step(layer, jnp.asarray(x[:, t : t + 1]), state)
    np.testing.assert_allclose(np.asarray(y)[:, 0], full[:, t], atol=FORMS_ATOL, rtol=0)
  assert state.conv.shape == (2, 3, 2 * 2 * 8 + 4 * 6) and state.recurrent.shape == (2, 4, 8, 6)
  assert state.recurrent.dtype == jnp.float32


def test_decode_state_matches_transformers_cache(gdn):
  """Prefill with Hugging Face's cache, then decode steps: the same outputs as ours token for token."""
  hf, layer, x = gdn
  prompt, steps = 70, 3
  cache = qwen3_next.DynamicCache(config=hf_config())
  with torch.no_grad():
    refs = [_t(hf(torch.from_numpy(x[:, :prompt]), cache=cache))]
    refs += [_t(hf(torch.from_numpy(x[:, t : t + 1]), cache=cache)) for t in range(prompt, prompt + steps)]
  y, state = forward(layer, jnp.asarray(x[:, :prompt]), None)
  ours = [np.asarray(y)]
  for t in range(prompt, prompt + steps):
    y, state = step(layer, jnp.asarray(x[:, t : t + 1]), state)
    ours.append(np.asarray(y))
  np.testing.assert_allclose(np.concatenate(ours, 1), np.concatenate(refs, 1), atol=HF_ATOL, rtol=0)


# Row 0: documents of 70 and 50 tokens (a start inside the second chunk), then 30 tokens of padding.
# Row 1: documents of 64, 30 and 56 tokens (a start on a chunk boundary, two starts inside one chunk).
PACKED = [[(1, 70), (2, 50), (0, 30)], [(1, 64), (2, 30), (3, 56)]]


def _segments(row: list[tuple[int, int]]) -> np.ndarray:
  return np.concatenate([np.full(n, seg, np.int32) for seg, n in row])


def test_packed_row_equals_its_documents_alone(gdn):
  _, layer, x = gdn
  seg = np.stack([_segments(row) for row in PACKED])
  packed, state = forward(layer, jnp.asarray(x), jnp.asarray(seg))
  # each document alone, right-padded to SEQ (one row each, one compiled shape): padding must not change it either
  docs = [(b, start, n) for b, row in enumerate(PACKED) for start, (seg_id, n) in zip(np.cumsum([0] + [n for _, n in row]), row) if seg_id]
  alone_x = np.zeros((len(docs), SEQ, EMB), np.float32)
  alone_seg = np.zeros((len(docs), SEQ), np.int32)
  for i, (b, start, n) in enumerate(docs):
    alone_x[i, :n], alone_seg[i, :n] = x[b, start : start + n], 1
  alone, alone_state = forward(layer, jnp.asarray(alone_x), jnp.asarray(alone_seg))
  for i, (b, start, n) in enumerate(docs):
    np.testing.assert_allclose(np.asarray(packed)[b, start : start + n], np.asarray(alone)[i, :n], atol=FORMS_ATOL, rtol=0)
  # the state after a row's last real token is its last document's state (padding neither decays nor writes)
  for b in range(len(PACKED)):
    last = max(i for i, doc in enumerate(docs) if doc[0] == b)
    np.testing.assert_allclose(np.asarray(state.recurrent)[b], np.asarray(alone_state.recurrent)[last], atol=FORMS_ATOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(state.conv)[b], np.asarray(alone_state.conv)[last])


def test_recurrent_form_resets_at_documents_too(gdn):
  _, layer, x = gdn
  seg = jnp.asarray(np.stack([_segments(row) for row in PACKED]))
  mix = nnx.jit(lambda m, recurrent: m.mix(jnp.asarray(x), seg, None, recurrent=recurrent)[0], static_argnums=1)
  chunked, recurrent = mix(layer, False), mix(layer, True)
  np.testing.assert_allclose(np.asarray(chunked), np.asarray(recurrent), atol=FORMS_ATOL, rtol=0)


def test_gradients_are_finite_across_documents(gdn):
  """Masked decay ratios must not leak inf or NaN into the backward pass (exp of a masked difference)."""
  _, layer, x = gdn
  seg = jnp.asarray(np.stack([_segments(row) for row in PACKED]))
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(jnp.asarray(x), seg) ** 2)))(layer)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_value_heads_must_be_a_multiple_of_key_heads():
  with pytest.raises(ValueError, match="not a multiple"):
    GatedDeltaNetSpec(emb_dim=EMB, num_key_heads=3, num_value_heads=4, key_head_dim=8, value_head_dim=8)


def test_gated_attention_matches_transformers():
  """Qwen3NextAttention: sigmoid output gate from q_proj, (1 + w) QK norms, rotary on the first half of each head."""
  torch.manual_seed(0)
  config = hf_config()
  hf = qwen3_next.Qwen3NextAttention(config, layer_idx=3).float().eval()
  _perturb(hf, 2)
  seq = 20
  x = np.random.default_rng(1).normal(size=(2, seq, EMB)).astype(np.float32)
  positions = np.broadcast_to(np.arange(seq), (2, seq))
  with torch.no_grad():
    cos_sin = qwen3_next.Qwen3NextRotaryEmbedding(config)(torch.from_numpy(x), torch.from_numpy(positions.copy()))
    mask = torch.triu(torch.full((seq, seq), float("-inf")), 1)[None, None]
    ref = _t(hf(torch.from_numpy(x), position_embeddings=cos_sin, attention_mask=mask)[0])
  spec = AttentionSpec(
    emb_dim=EMB,
    num_query_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope=RopeSpec(theta=10_000.0),
    scale=8**-0.5,
    max_target_length=seq,
    qk_norm=NormSpec(1e-6, zero_centered=True),
    output_gate=True,
    partial_rotary_factor=0.5,
  )
  layer = Attention(spec, policy=POLICY, rngs=nnx.Rngs(0))
  layer.query.kernel[...] = jnp.asarray(_t(hf.q_proj.weight).T.reshape(EMB, 4, 16))
  layer.key.kernel[...] = jnp.asarray(_t(hf.k_proj.weight).T.reshape(EMB, 2, 8))
  layer.value.kernel[...] = jnp.asarray(_t(hf.v_proj.weight).T.reshape(EMB, 2, 8))
  layer.out.kernel[...] = jnp.asarray(_t(hf.o_proj.weight).T.reshape(4, 8, EMB))
  layer.query_norm.scale[...] = jnp.asarray(_t(hf.q_norm.weight))
  layer.key_norm.scale[...] = jnp.asarray(_t(hf.k_norm.weight))
  ours = np.asarray(nnx.jit(lambda m, x, p: m(x, p, None, 0))(layer, jnp.asarray(x), jnp.asarray(positions)))
  np.testing.assert_allclose(ours, ref, atol=HF_ATOL, rtol=0)


def test_partial_rotary_factor_must_rotate_an_even_part():
  with pytest.raises(ValueError, match="partial_rotary_factor"):
    AttentionSpec(emb_dim=EMB, num_query_heads=4, num_kv_heads=2, head_dim=8, rope=RopeSpec(), scale=1.0, max_target_length=8, partial_rotary_factor=0.375)
