"""DeepSeek V4's layers against transformers' DeepseekV4 modules on one tiny random model (float32, eager).

mHC as V4 stores it (attn_hc, ffn_hc, hc_head): its checkpoint tensors mapped onto HyperConnection / HyperHead
reproduce V4's connections exactly; this project's own form with the same tensors does not (the maths differs, see
maxtext.layers.mhc); the mapping round-trips bit-exact and refuses an hc_mult that contradicts the tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from maxtext.config import ConfigError
from maxtext.convert import hf_deepseek_v4 as v4
from maxtext.layers.compressed_attention import CompressedAttention, CompressedAttentionSpec
from maxtext.layers.mhc import HyperConnection, HyperHead
from maxtext.layers.mlp import MLPSpec
from maxtext.layers.moe import MoE, MoESpec, RoutingSpec, route
from maxtext.layers.norms import RMSNorm
from maxtext.layers.rope import RopeSpec
from maxtext.platform import Dtypes, Policy
from tests.hf_fixtures import away_from_init

POLICY = Policy("cpu", dtypes=Dtypes(params=jnp.float32, compute=jnp.float32, precision=jax.lax.Precision.HIGHEST))
COMPRESS_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}
SEQ = 11  # not a multiple of the CSA rate 2 nor the HCA rate 4 (the parity tests add 12: both divide)


def tiny_config(**edit) -> transformers.DeepseekV4Config:
  """A hash-MoE first layer, then sliding, CSA and HCA layers; hc_mult 4; compression rates 2 (CSA) and 4 (HCA)."""
  fields = dict(
    vocab_size=97,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=12,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    partial_rotary_factor=0.5,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    hc_mult=4,
    hc_sinkhorn_iters=5,
    sliding_window=4,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=8,  # ties in the ReLU scores (which top-k breaks its own way) are then rare
    index_head_dim=8,
    index_topk=2,
    swiglu_limit=1.0,  # low enough that the clamps act
    max_position_embeddings=64,
    rope_parameters=COMPRESS_YARN,  # V4's compressed layers rotate with YaRN (no cos/sin scaling), the sliding ones plainly
    attn_implementation="eager",
  )
  return transformers.DeepseekV4Config(**{**fields, **edit})


@pytest.fixture(scope="module")
def hf_model() -> transformers.DeepseekV4ForCausalLM:
  torch.manual_seed(0)
  model = transformers.DeepseekV4ForCausalLM(tiny_config()).eval()
  away_from_init(model)
  with torch.no_grad():
    for layer in model.model.layers:
      if layer.mlp.is_hash:
        layer.mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(4)[:2] for _ in range(97)]))
  return model


def _np(t: torch.Tensor) -> np.ndarray:
  return t.detach().float().numpy()


def _streams(seed: int = 0) -> torch.Tensor:
  return torch.randn((2, SEQ, 4, 32), generator=torch.Generator().manual_seed(seed))


def _connection(hc: torch.nn.Module, config, hc_eps: float | None) -> HyperConnection:
  conn = HyperConnection(4, 32, config.hc_sinkhorn_iters, weight_dtype=jnp.float32, hc_eps=hc_eps, norm_eps=config.rms_norm_eps)
  for name, value in v4.connection_from_hf(_np(hc.fn), _np(hc.base), _np(hc.scale), 4).items():
    getattr(conn, name)[...] = jnp.asarray(value)
  return conn


@pytest.mark.parametrize("which", ["attn_hc", "ffn_hc"])
def test_mhc_as_v4_stores_it_matches_v4(hf_model, which):
  """Every layer's connection: H_post, H_res (= C^T), the branch input, and the whole update x' = C^T x + H_post F(.)."""
  config = hf_model.config
  x = _streams()
  for layer in hf_model.model.layers:
    hc = getattr(layer, which)
    with torch.no_grad():
      post, comb, collapsed = hc(x)
    conn = _connection(hc, config, config.hc_eps)
    h_pre, h_post, h_res = (np.asarray(a) for a in conn.mixing(jnp.asarray(x.numpy())))
    np.testing.assert_allclose(h_post, _np(post), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_res, np.swapaxes(_np(comb), -1, -2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose((h_pre[..., None] * x.numpy()).sum(-2), _np(collapsed), rtol=1e-5, atol=1e-5)
    branch = torch.nn.Linear(32, 32)
    with torch.no_grad():
      expected = post.unsqueeze(-1) * branch(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
    w, b = jnp.asarray(_np(branch.weight)), jnp.asarray(_np(branch.bias))
    ours = conn(jnp.asarray(x.numpy()), lambda h, w=w, b=b: h @ w.T + b)
    np.testing.assert_allclose(np.asarray(ours), _np(expected), rtol=1e-4, atol=1e-5)


def test_our_mhc_form_differs_from_v4s(hf_model):
  """The same tensors in this project's form (no hc_eps, rows-first log-domain Sinkhorn) give other H_pre and H_res."""
  hc = hf_model.model.layers[1].attn_hc
  x = _streams()
  with torch.no_grad():
    _, comb, _ = hc(x)
  h_pre, _, h_res = _connection(hc, hf_model.config, None).mixing(jnp.asarray(x.numpy()))
  v4_pre, _, _ = _connection(hc, hf_model.config, hf_model.config.hc_eps).mixing(jnp.asarray(x.numpy()))
  np.testing.assert_allclose(np.asarray(v4_pre - h_pre), hf_model.config.hc_eps, atol=5e-8)
  assert np.abs(np.asarray(h_res) - np.swapaxes(_np(comb), -1, -2)).max() > 1e-3


def test_hyper_head_matches_v4(hf_model):
  head_hf = hf_model.model.hc_head
  config = hf_model.config
  head = HyperHead(4, 32, weight_dtype=jnp.float32, hc_eps=config.hc_eps, norm_eps=config.rms_norm_eps)
  for name, value in v4.head_from_hf(_np(head_hf.hc_fn), _np(head_hf.hc_base), _np(head_hf.hc_scale)).items():
    getattr(head, name)[...] = jnp.asarray(value)
  x = _streams(1)
  with torch.no_grad():
    expected = head_hf(x)
  np.testing.assert_allclose(np.asarray(head(jnp.asarray(x.numpy()))), _np(expected), rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(head(jnp.asarray(x.numpy()))) - x.numpy().mean(-2)).max() > 1e-2  # not the mean collapse


def test_mhc_mapping_round_trips_bit_exact(hf_model):
  for layer in hf_model.model.layers:
    for hc in (layer.attn_hc, layer.ffn_hc):
      fn, base, scale = _np(hc.fn), _np(hc.base), _np(hc.scale)
      back = v4.connection_to_hf(v4.connection_from_hf(fn, base, scale, 4))
      for got, want in zip(back, (fn, base, scale)):
        np.testing.assert_array_equal(got, want)
  head = hf_model.model.hc_head
  tensors = (_np(head.hc_fn), _np(head.hc_base), _np(head.hc_scale))
  for got, want in zip(v4.head_to_hf(v4.head_from_hf(*tensors)), tensors):
    np.testing.assert_array_equal(got, want)


def test_hc_mult_contradicting_the_checkpoint_is_refused(hf_model):
  hc = hf_model.model.layers[0].attn_hc
  with pytest.raises(ConfigError, match="hc_mult=2"):
    v4.connection_from_hf(_np(hc.fn), _np(hc.base), _np(hc.scale), 2)


def _jit_call(module, *args, **kwargs):
  """module(*args, **kwargs) compiled whole (much faster on CPU than the first eager call's op-by-op compiles)."""
  graphdef, state = nnx.split(module)
  return jax.jit(lambda st, a, kw: nnx.merge(graphdef, st)(*a, **kw))(state, args, kwargs)


def _set(module, path: str, value: np.ndarray) -> None:
  *parents, leaf = path.split(".")
  for name in parents:
    module = getattr(module, name)
  param = getattr(module, leaf)
  assert param[...].shape == value.shape, (path, param[...].shape, value.shape)
  param[...] = jnp.asarray(value, param[...].dtype)


def attention_spec(config, layer: int) -> CompressedAttentionSpec:
  layer_type = config.layer_types[layer]
  return CompressedAttentionSpec(
    emb_dim=config.hidden_size,
    num_heads=config.num_attention_heads,
    head_dim=config.head_dim,
    rope_dim=config.qk_rope_head_dim,
    q_lora_rank=config.q_lora_rank,
    o_groups=config.o_groups,
    o_lora_rank=config.o_lora_rank,
    window=config.sliding_window,
    layer_type=layer_type,
    compress_rate=config.compress_rates.get(layer_type, 0),
    index_heads=config.index_n_heads,
    index_head_dim=config.index_head_dim,
    index_topk=config.index_topk,
    rope=RopeSpec(theta=config.rope_parameters["main"]["rope_theta"]),
    compress_rope=RopeSpec(
      kind="yarn",
      theta=config.rope_parameters["compress"]["rope_theta"],
      yarn_factor=COMPRESS_YARN["factor"],
      yarn_original_max_position=COMPRESS_YARN["original_max_position_embeddings"],
      beta_fast=COMPRESS_YARN["beta_fast"],
      beta_slow=COMPRESS_YARN["beta_slow"],
    ),
    epsilon=config.rms_norm_eps,
  )


def _captured_attention(model, tokens: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
  """Each layer's self_attn input and output in a forward pass of the whole model."""
  seen, hooks = {}, []
  for i, layer in enumerate(model.model.layers):

    def hook(module, args, kwargs, output, i=i):
      seen[i] = (_np(args[0] if args else kwargs["hidden_states"]), _np(output[0]))

    hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
  try:
    with torch.no_grad():
      model(torch.as_tensor(tokens))
  finally:
    for h in hooks:
      h.remove()
  return seen


@pytest.mark.parametrize("seq", [3, SEQ + 1])
def test_attention_layers_match_v4(hf_model, seq):
  """Sliding, CSA (indexer top-2 of 6 entries) and HCA layers, the sequence a multiple of both rates (the layer test
  below takes one of neither), or shorter than the HCA window (no entry yet)."""
  tokens = np.random.default_rng(seq).integers(0, 97, (2, seq))
  seen = _captured_attention(hf_model, tokens)
  positions = jnp.broadcast_to(jnp.arange(seq), (2, seq))
  for i, layer in enumerate(hf_model.model.layers):
    spec = attention_spec(hf_model.config, i)
    ours = CompressedAttention(spec, policy=POLICY, rngs=nnx.Rngs(0))
    weights = {k: _np(v) for k, v in layer.self_attn.state_dict().items()}
    for path, name, (to_ours, _) in v4.attention_mapping(spec):
      _set(ours, path, to_ours(weights[name]))
    x, expected = seen[i]
    np.testing.assert_allclose(np.asarray(_jit_call(ours, jnp.asarray(x), positions)), expected, rtol=1e-4, atol=1e-5, err_msg=spec.layer_type)


def test_attention_mapping_round_trips_bit_exact(hf_model):
  for i, layer in enumerate(hf_model.model.layers):
    weights = {k: _np(v) for k, v in layer.self_attn.state_dict().items()}
    rows = v4.attention_mapping(attention_spec(hf_model.config, i))
    assert {name for _, name, _ in rows} == set(weights)
    for _, name, (to_ours, to_hf) in rows:
      np.testing.assert_array_equal(to_hf(to_ours(weights[name])), weights[name])


def moe_spec(config, layer: int) -> MoESpec:
  hashed = config.mlp_layer_types[layer] == "hash_moe"
  glu = dict(glu_limit=config.swiglu_limit, glu_clamp_only=True)
  return MoESpec(
    emb_dim=config.hidden_size,
    width=config.moe_intermediate_size,
    routing=RoutingSpec(
      config.n_routed_experts, config.num_experts_per_tok, config.scoring_func, renormalize=True, scaling_factor=config.routed_scaling_factor
    ),
    activations=("silu", "linear"),
    score_correction=not hashed,
    shared=MLPSpec(config.hidden_size, config.n_shared_experts * config.moe_intermediate_size, ("silu", "linear"), **glu),
    hash_vocab=config.vocab_size if hashed else 0,
    **glu,
  )


def test_moe_mapping_round_trips_bit_exact(hf_model):
  for layer in hf_model.model.layers:
    weights = {k: v.detach().numpy() for k, v in layer.mlp.state_dict().items()}
    rows = v4.moe_mapping(layer.mlp.is_hash)
    assert {name for _, name, _ in rows} | {"experts.gate_up_proj"} == set(weights)
    for _, name, (to_ours, to_hf) in rows:
      np.testing.assert_array_equal(to_hf(to_ours(weights[name])), weights[name])
    np.testing.assert_array_equal(v4.experts_to_hf(*v4.experts_from_hf(weights["experts.gate_up_proj"])), weights["experts.gate_up_proj"])


def test_decoder_layers_compose_as_v4s(hf_model):
  """Each whole V4 layer (both connections around the normed attention and MoE) from our modules, on V4's streams: the
  attention with the sequence a multiple of neither rate; the MoE's sqrtsoftplus scores, score correction, hash
  routing by tid2eid and clamped SwiGLU (experts and shared expert)."""
  config = hf_model.config
  tokens = np.random.default_rng(5).integers(0, 97, (2, SEQ))
  seen, hooks = {}, []
  for i, layer in enumerate(hf_model.model.layers):

    def hook(module, args, kwargs, output, i=i):
      seen[i] = (_np(args[0] if args else kwargs["hidden_states"]), _np(output))

    hooks.append(layer.register_forward_hook(hook, with_kwargs=True))
    hooks.append(layer.mlp.register_forward_hook(lambda module, args, output, i=i: moe_inputs.__setitem__(i, _np(args[0]))))
  moe_inputs = {}
  with torch.no_grad():
    hf_model(torch.as_tensor(tokens))
  for h in hooks:
    h.remove()
  positions = jnp.broadcast_to(jnp.arange(SEQ), (2, SEQ))
  clamped = False
  for i, layer in enumerate(hf_model.model.layers):
    attention = CompressedAttention(attention_spec(config, i), policy=POLICY, rngs=nnx.Rngs(0))
    weights = {k: _np(v) for k, v in layer.self_attn.state_dict().items()}
    for path, name, (to_ours, _) in v4.attention_mapping(attention.spec):
      _set(attention, path, to_ours(weights[name]))
    moe = MoE(moe_spec(config, i), policy=POLICY, rngs=nnx.Rngs(0))
    weights = {k: v.detach().numpy() for k, v in layer.mlp.state_dict().items()}
    for path, name, (to_ours, _) in v4.moe_mapping(layer.mlp.is_hash):
      _set(moe, path, to_ours(weights[name]))
    for path, value in zip(("wi_0", "wi_1"), v4.experts_from_hf(weights["experts.gate_up_proj"])):
      _set(moe, path, value)
    norms = [RMSNorm(32, config.rms_norm_eps, dtype=jnp.float32, weight_dtype=jnp.float32) for _ in range(2)]
    norms[0].scale[...] = jnp.asarray(_np(layer.input_layernorm.weight))
    norms[1].scale[...] = jnp.asarray(_np(layer.post_attention_layernorm.weight))
    attn_hc, ffn_hc = (_connection(hc, config, config.hc_eps) for hc in (layer.attn_hc, layer.ffn_hc))
    x, expected = seen[i]
    layer_modules = nnx.List([attn_hc, norms[0], attention, ffn_hc, norms[1], moe])

    def whole_layer(modules, x):
      attn_hc, attn_norm, attention, ffn_hc, ffn_norm, moe = modules
      x = attn_hc(x, lambda h: attention(attn_norm(h), positions))
      return ffn_hc(x, lambda h: moe(ffn_norm(h), jnp.ones((2, SEQ), bool), token_ids=jnp.asarray(tokens))[0])

    graphdef, state = nnx.split(layer_modules)
    x = jax.jit(lambda st, x, g=graphdef: whole_layer(nnx.merge(g, st), x))(state, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(x), expected, rtol=1e-4, atol=1e-4, err_msg=f"layer {i}")
    clamped |= bool(np.abs(np.einsum("bse,nei->bsni", moe_inputs[i], np.asarray(moe.wi_0[...]))).max() > config.swiglu_limit)
  assert clamped  # the SwiGLU limit acts on these activations


def _param_count(build) -> int:
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(nnx.eval_shape(build), nnx.Param)))


def test_deepseek4_284b_layers_count_284b_parameters():
  """DeepSeek-V4-Flash from MaxText's deepseek4-284b.yml (43 layers: 2 sliding, then CSA and HCA alternating from a CSA
  layer; 256 experts of 2048 and one shared; mHC n = 4; MTP aside): the published 284B within 1.5%."""
  emb, vocab, ratios = 4096, 129280, [0, 0, 4] + [128, 4] * 20
  kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}

  def attention(rate: int) -> int:
    spec = CompressedAttentionSpec(emb, 64, 512, 64, 1024, 8, 1024, 128, kinds[rate], rate, 64, 128, 512)
    return _param_count(lambda: CompressedAttention(spec, policy=POLICY, rngs=nnx.Rngs(0)))

  routing = RoutingSpec(256, 6, "sqrtsoftplus", renormalize=True, scaling_factor=1.5)
  moe = _param_count(
    lambda: MoE(MoESpec(emb, 2048, routing, ("silu", "linear"), shared=MLPSpec(emb, 2048, ("silu", "linear"))), policy=POLICY, rngs=nnx.Rngs(0))
  )
  connection = _param_count(lambda: HyperConnection(4, emb, 20, weight_dtype=jnp.float32))
  head = _param_count(lambda: HyperHead(4, emb, weight_dtype=jnp.float32, hc_eps=1e-6, norm_eps=1e-6))
  per_rate = {rate: attention(rate) for rate in kinds}
  total = 2 * vocab * emb + sum(per_rate[r] for r in ratios) + len(ratios) * (moe + 2 * connection + 2 * emb) + head + emb
  assert per_rate[4] > per_rate[128] > per_rate[0]  # the indexer and the overlapping compressor cost most
  assert abs(total / 284e9 - 1) < 0.015, total


def test_unknown_layer_and_router_types_are_refused():
  with pytest.raises(ValueError, match="unknown DeepSeek V4 layer type 'full_attention'"):
    CompressedAttentionSpec(32, 4, 16, 8, 12, 2, 8, 4, "full_attention", 4)
  with pytest.raises(ValueError, match="needs a compress rate above 0"):
    CompressedAttentionSpec(32, 4, 16, 8, 12, 2, 8, 4, "heavily_compressed_attention", 0)
  with pytest.raises(ValueError, match="unknown routed_score_func 'sqrt'"):
    route(jnp.zeros((2, 4)), RoutingSpec(4, 2, "sqrt"))
