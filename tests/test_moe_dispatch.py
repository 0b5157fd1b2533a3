"""MoE dispatch paths: every path gives the loss and gradients of a plain reference, on one device and with expert
parallelism, dropless and with capacity, on mixtral-, qwen3-moe-, deepseek- and gpt-oss-shaped tiny layers.

The paths (maxtext.platform.moe_dispatch): dense, ragged_dot, megablox (Pallas TPU kernels in interpret mode),
tokamax (its XLA implementation on CPU). The reference routes with the same `moe.route` and computes every
(token, expert) pair with plain jnp (no sorting, no shard_map, plain autodiff), dropping the pairs past each
sequence's capacity by a numpy count.

Coverage, within the CI budget (each variant is a compile): on one device every path, dropless and with capacity
(mixtral-shaped); with expert parallelism, ep4 x fsdp2 (qwen3-moe-shaped) and ep2 x fsdp2 x sequence2
(deepseek-shaped, capacity counted across sequence shards), each path at least once and the sorted and dense
paths both dropless and with capacity; the sorted paths with their experts in chunks (expert_gather_chunks: 2 chunks
on one device, 2 of the 2 local experts with ep4, 4 of 4 with ep2, weights gathered over fsdp per chunk); gpt-oss-shaped (nonzero expert and router biases, clamped SwiGLU) with ep4 x
fsdp2, sorted and dense. The sorted paths share all dispatch code and differ only in the grouped
matmul, which test_grouped_kernels_compute_the_grouped_products checks kernel by kernel. Each test compiles its
variants in one jitted function, without XLA's backend optimisations (compile time is most of the cost).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import mesh as mesh_lib
from maxtext import platform
from maxtext.config import from_overrides
from maxtext.layers import grouped_matmul as gmm
from maxtext.layers import moe
from maxtext.layers.mlp import glu
from maxtext.models import feed_forward_specs
from tests.test_train_helpers import FAST_COMPILE

BASE = dict(vocab_size=64, base_num_query_heads=2, base_num_kv_heads=2, head_dim=8, base_num_decoder_layers=1, dtype="float32")
SHAPES = {
  "mixtral": dict(decoder_block="mixtral", base_emb_dim=16, base_mlp_dim=12, num_experts=4, num_experts_per_tok=2),
  "qwen3_moe": dict(decoder_block="qwen3_moe", base_emb_dim=16, base_mlp_dim=24, base_moe_mlp_dim=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
  "deepseek": dict(
    decoder_block="deepseek",
    base_emb_dim=16,
    base_mlp_dim=24,
    base_moe_mlp_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    shared_experts=1,
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
  ),
  "gpt_oss": dict(  # expert biases, a router bias and the clamped SwiGLU
    decoder_block="gpt_oss",
    base_emb_dim=16,
    base_mlp_dim=24,
    base_moe_mlp_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    routed_bias=True,
    mlp_bias=True,
    norm_topk_prob=True,
    mlp_activations=["sigmoid", "linear"],
    mlp_activations_limit=0.5,
  ),
}
PATHS = ("dense", "ragged_dot", "megablox", "tokamax")
CAPACITY = 1.0  # per sequence of 8 tokens x 2 picks: 4 slots of 16 pairs for 4 experts, 2 for 8: pairs are dropped
B, S = 8, 8


def _config(shape: str, capacity_factor: float, **mesh):
  return from_overrides(**dict(BASE, **SHAPES[shape], capacity_factor=capacity_factor, **mesh))


def _layer(config, path: str) -> moe.MoE:
  policy = dataclasses.replace(platform.for_platform(config, "cpu", interpret=True), moe_dispatch=path)
  return moe.MoE(feed_forward_specs.moe(config), policy=policy, rngs=nnx.Rngs(0))


def _variant_layer(shape: str, variant: str, capacity_factor: float, mesh_keys: dict) -> moe.MoE:
  """A variant is a dispatch path, or "path/N": that path with its experts run in N chunks (expert_gather_chunks)."""
  path, _, chunks = variant.partition("/")
  return _layer(_config(shape, capacity_factor, expert_gather_chunks=int(chunks or 0), **mesh_keys), path)


def _inputs(shape: str):
  rng = np.random.default_rng(7)
  emb = SHAPES[shape]["base_emb_dim"]
  x = rng.normal(size=(B, S, emb)).astype(np.float32)
  cotangent = rng.normal(size=(B, S, emb)).astype(np.float32)
  valid = np.ones((B, S), bool)
  valid[-1, -3:] = False  # padding tokens: routed and computed, not counted
  return jnp.asarray(x), jnp.asarray(cotangent), jnp.asarray(valid)


def _kept(layer: moe.MoE, x: jax.Array) -> np.ndarray:
  """[B, S, k]: whether each pair is within its expert's capacity in its sequence, counted in numpy."""
  spec = layer.spec
  experts = np.asarray(_route(layer, x).experts).reshape(B, S, -1)
  kept = np.ones_like(experts, bool)
  if spec.capacity_factor > 0:
    cap = moe.expert_capacity(S, spec)
    for b in range(B):
      seen = np.zeros(spec.routing.num_experts, int)
      for s in range(S):
        for j in range(experts.shape[-1]):
          kept[b, s, j] = seen[experts[b, s, j]] < cap
          seen[experts[b, s, j]] += 1
  return kept


def _route(layer: moe.MoE, x: jax.Array) -> moe.Routing:
  bias = layer.routed_bias[...] if layer.routed_bias is not None else None
  return moe.route(layer.gate(x.reshape(B * S, -1)), layer.spec.routing, bias)


def _reference(layer: moe.MoE, x: jax.Array, kept: np.ndarray) -> jax.Array:
  """y [B, S, E] of the layer with plain jnp: every pair through its expert, weighted, the pairs not kept dropped."""
  tokens = x.reshape(B * S, -1)
  r = _route(layer, x)
  spec = layer.spec

  def project(x: jax.Array, name: str, spec: str) -> jax.Array:
    y = jnp.einsum(spec, x, getattr(layer, name)[...])
    return y if getattr(layer, name + "_bias") is None else y + getattr(layer, name + "_bias")[...]

  h = glu(spec.activations, spec.glu_limit)(project(tokens, "wi_0", "td,edf->tef"), project(tokens, "wi_1", "td,edf->tef"))
  out = project(h, "wo", "tef,efd->ted")  # [T, E, d]
  chosen = jnp.take_along_axis(out, r.experts[:, :, None], axis=1)  # [T, k, d]
  y = jnp.einsum("tkd,tk->td", chosen, r.weights * kept.reshape(B * S, -1)).reshape(x.shape)
  return y if layer.shared_experts is None else y + layer.shared_experts(x)


def _loss_fns(shape: str, variants: list[tuple[str, float]], mesh_keys: dict):
  """One jitted function: (params, x) -> per variant (loss, dropped, grads); plus the reference, same params."""
  x, cotangent, valid = _inputs(shape)
  layers = [_variant_layer(shape, path, cf, mesh_keys) for path, cf in variants]
  graphdefs = [nnx.graphdef(layer) for layer in layers]
  rng = np.random.default_rng(5)  # biases start at zero: make them count
  state = jax.tree.map_with_path(
    lambda path, v: v + rng.normal(0.0, 0.5, v.shape).astype(v.dtype) if "bias" in jax.tree_util.keystr(path) else v, nnx.state(layers[0])
  )

  def run(st, x):
    out = []
    for graphdef in graphdefs:

      def loss(st, x, graphdef=graphdef):
        y, stats = nnx.merge(graphdef, st)(x, valid)
        return jnp.sum(y * cotangent), stats["dropped"]

      out.append(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(st, x))
    return out

  return jax.jit(run, compiler_options=FAST_COMPILE), state, x


def _references(shape: str, state, x, variants):
  """(loss, dropped), grads of the reference for each capacity_factor among the variants."""
  _, cotangent, valid = _inputs(shape)
  out = {}
  for cf in sorted({cf for _, cf in variants}):
    graphdef = nnx.graphdef(_layer(_config(shape, cf), "ragged_dot"))
    kept = _kept(nnx.merge(graphdef, state), x)
    dropped = jnp.asarray(np.sum(~kept * np.asarray(valid)[..., None]), jnp.float32)

    def loss(st, x, graphdef=graphdef, kept=kept):
      return jnp.sum(_reference(nnx.merge(graphdef, st), x, kept) * cotangent)

    out[cf] = ((loss_and_grads := jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), compiler_options=FAST_COMPILE)(state, x))[0], dropped), loss_and_grads[1]
  return out


def _check(results, references, variants):
  leaves = lambda t: [np.asarray(a) for a in jax.tree.leaves(t)]  # noqa: E731
  for ((loss, dropped), grads), (path, cf) in zip(results, variants, strict=True):
    (ref_loss, ref_dropped), ref_grads = references[cf]
    where = f"{path}, capacity_factor={cf}"
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=where)
    assert float(dropped) == float(ref_dropped), where
    for got, want in zip(leaves(grads), leaves(ref_grads), strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=where)
  assert CAPACITY not in references or float(references[CAPACITY][0][1]) > 0, "capacity should drop pairs in this test"


DROPLESS = -1.0
ONE_DEVICE = [(path, cf) for path in PATHS for cf in (DROPLESS, CAPACITY) if (path, cf) != ("tokamax", CAPACITY)] + [("ragged_dot/2", CAPACITY)]
EXPERT_PARALLEL = {
  "qwen3_moe": (
    [("ragged_dot", DROPLESS), ("ragged_dot", CAPACITY), ("dense", DROPLESS), ("megablox", DROPLESS), ("ragged_dot/2", DROPLESS)],
    dict(ici_fsdp_parallelism=2, ici_expert_parallelism=4),
  ),
  "deepseek": (
    [("dense", CAPACITY), ("tokamax", DROPLESS), ("megablox", CAPACITY), ("megablox/4", DROPLESS)],
    dict(ici_fsdp_parallelism=2, ici_sequence_parallelism=2, ici_expert_parallelism=2),
  ),
  "gpt_oss": ([("ragged_dot", DROPLESS), ("megablox", CAPACITY), ("dense", DROPLESS)], dict(ici_fsdp_parallelism=2, ici_expert_parallelism=4)),
}


def test_every_path_matches_the_reference_on_one_device():
  fn, state, x = _loss_fns("mixtral", ONE_DEVICE, {})
  _check(fn(state, x), _references("mixtral", state, x, ONE_DEVICE), ONE_DEVICE)


@pytest.mark.parametrize("shape", list(EXPERT_PARALLEL), ids=["qwen3_moe-ep4-fsdp2", "deepseek-ep2-fsdp2-sp2", "gpt_oss-ep4-fsdp2"])
def test_every_path_matches_the_reference_with_expert_parallelism(shape):
  """On the 8 simulated devices tokens reach their experts' devices (ragged exchange, emulated on CPU, or
  all_to_all of [E, slots] buffers for dense), weights are gathered over fsdp and their gradients reduce-scattered."""
  variants, mesh_keys = EXPERT_PARALLEL[shape]
  mesh_keys = dict(mesh_keys, num_devices=8)
  fn, state, x = _loss_fns(shape, variants, mesh_keys)
  with jax.set_mesh(mesh_lib.create(_config(shape, DROPLESS, **mesh_keys))):
    compiled = fn.lower(state, x).compile()
    results = compiled(state, x)
  assert "all-to-all" in compiled.as_text()
  _check(results, _references(shape, state, x, variants), variants)


def test_grouped_kernels_compute_the_grouped_products():
  """fwd, dlhs and drhs of every kernel against numpy, with an empty group, rows past the groups, row padding and
  blocks that do not divide the contracted and produced dimensions (megablox masks them)."""
  rng = np.random.default_rng(3)
  m, k, n, sizes = 40, 24, 20, np.array([7, 0, 13, 9], np.int32)  # 29 rows in groups, 11 past them
  lhs, grad = rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(m, n)).astype(np.float32)
  rhs = rng.normal(size=(4, k, n)).astype(np.float32)
  tiles = gmm.Tiles(fwd=(16, 16, 16), dlhs=(16, 16, 8), drhs=(8, 16, 16))
  rows = tiles.padded_rows(m)
  assert rows == 48 and all(rows % t[0] == 0 for t in (tiles.fwd, tiles.dlhs, tiles.drhs))
  starts = np.concatenate([[0], np.cumsum(sizes)])
  want_fwd, want_dlhs, want_drhs = np.zeros((m, n)), np.zeros((m, k)), np.zeros((4, k, n))
  for g in range(4):
    r = slice(starts[g], starts[g + 1])
    want_fwd[r], want_dlhs[r], want_drhs[g] = lhs[r] @ rhs[g], grad[r] @ rhs[g].T, lhs[r].T @ grad[r]
  pad = lambda a: jnp.pad(jnp.asarray(a), ((0, rows - m), (0, 0)))  # noqa: E731

  @jax.jit
  def products(lhs, rhs, grad, sizes):
    out = []
    for kernel in (gmm.Kernel("ragged_dot"), gmm.Kernel("megablox", interpret=True), gmm.Kernel("tokamax", tokamax_implementation="xla")):
      f32 = jnp.float32
      out.append(
        (
          kernel.fwd(pad(lhs), rhs, sizes, tiles.fwd, f32)[:m],
          kernel.dlhs(pad(grad), rhs, sizes, tiles.dlhs, f32)[:m],
          kernel.drhs(pad(lhs), pad(grad), sizes, tiles.drhs, f32),
        )
      )
    return out

  for name, (fwd, dlhs, drhs) in zip(gmm.KERNELS, products(lhs, rhs, grad, sizes), strict=True):
    in_groups = slice(0, int(sizes.sum()))
    np.testing.assert_allclose(fwd[in_groups], want_fwd[in_groups], rtol=1e-4, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(dlhs[in_groups], want_dlhs[in_groups], rtol=1e-4, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(drhs, want_drhs, rtol=1e-4, atol=1e-4, err_msg=name)


def test_platform_policy_picks_the_dispatch():
  """MaxText's keys decide when set off their defaults; the defaults take each platform's measured choice."""
  mixtral, many = _config("mixtral", -1.0), _config("qwen3_moe", -1.0).model_copy(update={"num_experts": 64, "num_experts_per_tok": 4})
  assert platform.moe_dispatch(mixtral, "tpu") == platform.moe_dispatch(many, "tpu") == "megablox"
  assert platform.moe_dispatch(many, "gpu") == "ragged_dot"
  for p in platform.PLATFORMS:
    assert platform.moe_dispatch(mixtral.model_copy(update={"sparse_matmul": False}), p) == "dense"
    assert platform.moe_dispatch(mixtral.model_copy(update={"megablox": False}), p) == "ragged_dot"
    assert platform.moe_dispatch(mixtral.model_copy(update={"use_tokamax_gmm": True}), p) == "tokamax"
  assert platform.for_platform(mixtral, "cpu").ragged_all_to_all is False
  assert platform.for_platform(mixtral, "tpu").ragged_all_to_all is True


@pytest.mark.parametrize("mesh_keys", [{}, dict(num_devices=8, ici_fsdp_parallelism=2, ici_expert_parallelism=4)], ids=["one_device", "ep4"])
def test_remat_policy_decides_what_the_moe_saves(mesh_keys):
  """The experts' hidden activations [pairs, moe_mlp] are named mlpwi_0/mlpwi_1 (inside the shard_map too) and the
  layer output mlpwo, so `remat_policy` picks what the backward pass keeps."""
  from maxtext.models import remat

  config = _config("qwen3_moe", DROPLESS, **mesh_keys)
  graphdef, state = nnx.split(_layer(config, "ragged_dot"))
  x, _, valid = _inputs("qwen3_moe")

  def saved(policy: str) -> list[str]:
    fn = jax.checkpoint(lambda st, x: jnp.sum(jnp.sin(nnx.merge(graphdef, st)(x, valid)[0])), policy=remat.policy(policy))
    out = io.StringIO()
    with jax.set_mesh(mesh_lib.create(config)) if mesh_keys else contextlib.nullcontext(), contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(fn, state, x)
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line]

  hidden = lambda lines: [line for line in lines if line.split(" ")[0].endswith(",8]")]  # noqa: E731  (moe_mlp_dim 8)
  minimal, except_mlpwi, full = saved("minimal"), saved("save_dot_except_mlpwi"), saved("full")
  assert len(hidden(minimal)) == 2 and sum("'mlpwo'" in line for line in minimal) == 1, minimal
  assert not hidden(except_mlpwi) and len(except_mlpwi) == 1 and "'mlpwo'" in except_mlpwi[0], except_mlpwi
  assert not full, full


def test_expert_gather_chunks_follow_the_gathered_size():
  """expert_gather_chunks=0 picks the fewest chunks whose gathered expert matrix fits 2 GiB (deepseek3-671b's experts
  on FSDP alone: 256 x 7168 x 2048 bf16 is 7 GiB, 4 chunks; with expert parallelism 8, 32 local experts fit at once);
  nothing is chunked where nothing is gathered; an explicit count must divide a device's experts."""
  from maxtext.errors import ConfigError
  from maxtext.layers import moe_dispatch

  spec = feed_forward_specs.moe(_config("deepseek", DROPLESS))
  spec = dataclasses.replace(spec, emb_dim=7168, width=2048, routing=dataclasses.replace(spec.routing, num_experts=256))
  fsdp = moe_dispatch.Layout(wi=((), ("fsdp",), ()), wo=((), (), ("fsdp",)), sizes=(("fsdp", 128), ("expert", 8)))
  assert moe.gather_chunks(spec, fsdp, jnp.bfloat16) == 4
  assert moe.gather_chunks(spec, fsdp, jnp.float32) == 8
  assert moe.gather_chunks(spec, dataclasses.replace(fsdp, experts=("expert",), wi=(("expert",), ("fsdp",), ())), jnp.bfloat16) == 1
  assert moe.gather_chunks(spec, moe_dispatch.Layout(), jnp.bfloat16) == 1
  assert moe.gather_chunks(dataclasses.replace(spec, gather_chunks=2), moe_dispatch.Layout(), jnp.bfloat16) == 2
  with pytest.raises(ConfigError, match="does not divide the 32 experts"):
    moe.gather_chunks(dataclasses.replace(spec, gather_chunks=64), dataclasses.replace(fsdp, experts=("expert",)), jnp.bfloat16)
