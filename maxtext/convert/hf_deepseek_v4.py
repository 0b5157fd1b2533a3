"""DeepSeek V4 checkpoint tensors <-> this project's parameters, both ways, bit-exact (pure reindexing).

mHC (`attn_hc`, `ffn_hc`): `fn` [(2 + n) n, nE] holds the pre, post and combination rows, `base` [(2 + n) n] their
biases, `scale` [3] the three gains. Our HyperConnection holds them as columns (pre_proj, post_proj, res_proj), with
H_res the transpose of V4's combination matrix C, so res column m n + k is V4's row 2n + k n + m. The RMSNorm has
no scale in V4: norm_scale is all ones (and a trained one that is not cannot be exported).
The final `hc_head` (hc_fn [n, nE], hc_base [n], hc_scale [1]) maps onto HyperHead (proj, bias, scale).
"""

from __future__ import annotations

import numpy as np

from maxtext.errors import ConfigError


def _res_order(n: int) -> np.ndarray:
  """Our res column m n + k -> V4's combination index k n + m."""
  m, k = np.divmod(np.arange(n * n), n)
  return k * n + m


def connection_from_hf(fn: np.ndarray, base: np.ndarray, scale: np.ndarray, n: int) -> dict[str, np.ndarray]:
  """V4's (fn, base, scale) of one connection -> HyperConnection's parameters."""
  if fn.shape[0] != (2 + n) * n or fn.shape[1] % n:
    raise ConfigError(f"an mHC fn of shape {tuple(fn.shape)} does not fit hc_mult={n} (expected ((2 + n) n, n hidden) rows); set hc_mult to the checkpoint's")
  order = _res_order(n)
  return {
    "norm_scale": np.ones((fn.shape[1],), fn.dtype),
    "pre_proj": fn[:n].T,
    "post_proj": fn[n : 2 * n].T,
    "res_proj": fn[2 * n :][order].T,
    "pre_bias": base[:n],
    "post_bias": base[n : 2 * n],
    "res_bias": base[2 * n :][order],
    "pre_scale": scale[0],
    "post_scale": scale[1],
    "res_scale": scale[2],
  }


def connection_to_hf(params: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """HyperConnection's parameters -> V4's (fn, base, scale)."""
  if not np.all(np.asarray(params["norm_scale"]) == 1):
    raise ConfigError("this mHC connection has a learned norm scale, which DeepSeek V4's checkpoints cannot hold; export a model whose norm_scale stayed 1")
  n = params["pre_bias"].shape[0]
  inverse = np.argsort(_res_order(n))
  fn = np.concatenate([params["pre_proj"].T, params["post_proj"].T, params["res_proj"].T[inverse]], axis=0)
  base = np.concatenate([params["pre_bias"], params["post_bias"], params["res_bias"][inverse]])
  scale = np.stack([params["pre_scale"], params["post_scale"], params["res_scale"]]).reshape(3)
  return fn, base, scale


def head_from_hf(hc_fn: np.ndarray, hc_base: np.ndarray, hc_scale: np.ndarray) -> dict[str, np.ndarray]:
  """V4's hc_head -> HyperHead's parameters."""
  return {"proj": hc_fn.T, "bias": hc_base, "scale": hc_scale.reshape(())}


def head_to_hf(params: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """HyperHead's parameters -> V4's (hc_fn, hc_base, hc_scale)."""
  return params["proj"].T, params["bias"], np.asarray(params["scale"]).reshape(1)


def _linear(shape_after: tuple[int, ...] = ()) -> tuple:
  """A torch Linear weight [out, in] <-> our kernel [in, *out] (out reshaped to shape_after when given)."""

  def forward(w: np.ndarray) -> np.ndarray:
    k = w.T
    return k.reshape(k.shape[0], *shape_after) if shape_after else k

  def back(k: np.ndarray) -> np.ndarray:
    return k.reshape(k.shape[0], -1).T

  return forward, back


_SAME = (lambda a: a, lambda a: a)


def attention_mapping(spec) -> list[tuple[str, str, tuple]]:
  """(our path under the attention module, V4's name under self_attn, (to ours, to V4)) for one CompressedAttentionSpec."""
  h, d, g, r = spec.num_heads, spec.head_dim, spec.o_groups, spec.o_lora_rank

  def oa_forward(w: np.ndarray) -> np.ndarray:  # [G r, H D / G] -> [G, H D / G, r]
    return w.reshape(g, r, -1).transpose(0, 2, 1)

  def oa_back(k: np.ndarray) -> np.ndarray:
    return k.transpose(0, 2, 1).reshape(g * r, -1)

  def ob_forward(w: np.ndarray) -> np.ndarray:  # [E, G r] -> [G, r, E]
    return w.T.reshape(g, r, -1)

  def ob_back(k: np.ndarray) -> np.ndarray:
    return k.reshape(g * r, -1).T

  rows = [
    ("wq_a.kernel", "q_a_proj.weight", _linear()),
    ("q_norm.scale", "q_a_norm.weight", _SAME),
    ("wq_b.kernel", "q_b_proj.weight", _linear((h, d))),
    ("wkv.kernel", "kv_proj.weight", _linear()),
    ("kv_norm.scale", "kv_norm.weight", _SAME),
    ("wo_a.kernel", "o_a_proj.weight", (oa_forward, oa_back)),
    ("wo_b.kernel", "o_b_proj.weight", (ob_forward, ob_back)),
    ("sinks", "sinks", _SAME),
  ]

  def compressor(ours: str, theirs: str) -> list:
    return [
      (f"{ours}.wkv.kernel", f"{theirs}.kv_proj.weight", _linear()),
      (f"{ours}.wgate.kernel", f"{theirs}.gate_proj.weight", _linear()),
      (f"{ours}.position_bias", f"{theirs}.position_bias", _SAME),
      (f"{ours}.norm.scale", f"{theirs}.kv_norm.weight", _SAME),
    ]

  if spec.compress_rate:
    rows += compressor("compressor", "compressor")
  if spec.overlapping:
    rows += compressor("indexer.compressor", "compressor.indexer")
    rows += [
      ("indexer.wq_b.kernel", "compressor.indexer.q_b_proj.weight", _linear((spec.index_heads, spec.index_head_dim))),
      ("indexer.weights_proj.kernel", "compressor.indexer.scorer.weights_proj.weight", _linear()),
    ]
  return rows


def moe_mapping(hashed: bool) -> list[tuple[str, str, tuple]]:
  """(our path under the MoE module, V4's name under mlp, (to ours, to V4)); gate_up_proj [N, 2I, E] splits into
  wi_0 and wi_1 [N, E, I] (see moe_from_hf), so it is not a row here."""
  rows = [
    ("gate.kernel", "gate.weight", _linear()),
    ("wo", "experts.down_proj", (lambda w: w.transpose(0, 2, 1), lambda k: k.transpose(0, 2, 1))),
    ("shared_experts.wi_0.kernel", "shared_experts.gate_proj.weight", _linear()),
    ("shared_experts.wi_1.kernel", "shared_experts.up_proj.weight", _linear()),
    ("shared_experts.wo.kernel", "shared_experts.down_proj.weight", _linear()),
  ]
  if hashed:
    rows.append(("tid2eid", "gate.tid2eid", (lambda t: t.astype(np.int32), lambda t: t.astype(np.int64))))
  else:
    rows.append(("routed_bias", "gate.e_score_correction_bias", _SAME))
  return rows


def experts_from_hf(gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """V4's experts.gate_up_proj [N, 2I, E] -> (wi_0, wi_1) [N, E, I]."""
  width = gate_up.shape[1] // 2
  return gate_up[:, :width].transpose(0, 2, 1), gate_up[:, width:].transpose(0, 2, 1)


def experts_to_hf(wi_0: np.ndarray, wi_1: np.ndarray) -> np.ndarray:
  """(wi_0, wi_1) [N, E, I] -> V4's experts.gate_up_proj [N, 2I, E]."""
  return np.concatenate([wi_0.transpose(0, 2, 1), wi_1.transpose(0, 2, 1)], axis=1)
