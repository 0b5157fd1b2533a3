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


INTEGER_TENSORS = (".tid2eid",)  # tensors of integers (hash routing's table), not float weights
CONNECTIONS = (("attention_connection", "attn_hc"), ("mlp_connection", "ffn_hc"))  # ours -> V4's, in each layer
NORMS = (("pre_attention_norm/scale", "input_layernorm.weight"), ("pre_mlp_norm/scale", "post_attention_layernorm.weight"))
HEAD = (("hyper_head/proj", "model.hc_head.hc_fn"), ("hyper_head/bias", "model.hc_head.hc_base"), ("hyper_head/scale", "model.hc_head.hc_scale"))


def layer_from_hf(get, spec, hashed: bool, n: int, num_experts: int) -> dict[str, np.ndarray]:
  """One V4 decoder layer's tensors (get: its name under model.layers.<i>. -> the tensor) -> our parameters by path
  under the layer. spec: the layer's CompressedAttentionSpec; hashed: a hash-routed MoE; n: hc_mult."""
  out = {ours: get(theirs) for ours, theirs in NORMS}
  for path, name, (to_ours, _) in attention_mapping(spec):
    out["attention/" + path.replace(".", "/")] = to_ours(get("self_attn." + name))
  for path, name, (to_ours, _) in moe_mapping(hashed):
    out["mlp/" + path.replace(".", "/")] = to_ours(get("mlp." + name))
  if hashed and not ((out["mlp/tid2eid"] >= 0) & (out["mlp/tid2eid"] < num_experts)).all():
    raise ConfigError(f"a hash-routed layer's mlp.gate.tid2eid names an expert outside 0..{num_experts - 1}; the checkpoint disagrees with n_routed_experts")
  out["mlp/wi_0"], out["mlp/wi_1"] = experts_from_hf(get("mlp.experts.gate_up_proj"))
  for ours, theirs in CONNECTIONS:
    for name, value in connection_from_hf(get(f"{theirs}.fn"), get(f"{theirs}.base"), get(f"{theirs}.scale"), n).items():
      out[f"{ours}/{name}"] = np.asarray(value)
  return out


def layer_to_hf(get, spec, hashed: bool) -> dict[str, np.ndarray]:
  """Our parameters of one layer (get: path under the layer -> array) -> V4's tensors by name under model.layers.<i>."""
  out = {theirs: get(ours) for ours, theirs in NORMS}
  for path, name, (_, to_hf) in attention_mapping(spec):
    out["self_attn." + name] = to_hf(get("attention/" + path.replace(".", "/")))
  for path, name, (_, to_hf) in moe_mapping(hashed):
    out["mlp." + name] = to_hf(get("mlp/" + path.replace(".", "/")))
  out["mlp.experts.gate_up_proj"] = experts_to_hf(get("mlp/wi_0"), get("mlp/wi_1"))
  names = ("norm_scale", "pre_proj", "post_proj", "res_proj", "pre_bias", "post_bias", "res_bias", "pre_scale", "post_scale", "res_scale")
  for ours, theirs in CONNECTIONS:
    fn, base, scale = connection_to_hf({name: get(f"{ours}/{name}") for name in names})
    out.update({f"{theirs}.fn": fn, f"{theirs}.base": base, f"{theirs}.scale": scale})
  return out


def global_from_hf(get, n: int) -> dict[str, np.ndarray]:
  """The hc_head (get: V4's name -> tensor) -> HyperHead's parameters by path; n: hc_mult."""
  hc_fn = get(HEAD[0][1])
  if hc_fn.shape[0] != n or hc_fn.shape[1] % n:
    raise ConfigError(f"the hc_head's hc_fn of shape {tuple(hc_fn.shape)} does not fit hc_mult={n} (expected {n} rows); set hc_mult to the checkpoint's")
  head = head_from_hf(*(get(theirs) for _, theirs in HEAD))
  return {ours: np.asarray(head[ours.split("/")[1]]) for ours, _ in HEAD}


def global_to_hf(get) -> dict[str, np.ndarray]:
  """HyperHead's parameters (get: path -> array) -> V4's hc_head tensors by name."""
  tensors = head_to_hf({ours.split("/")[1]: get(ours) for ours, _ in HEAD})
  return {theirs: t for (_, theirs), t in zip(HEAD, tensors)}


# DeepSeek's checkpoint names (the hub's files, and what transformers writes: under model., the head as head.weight)
# -> transformers' module names, which the mappings above use. Per layer, then outside the layers.
_COMPRESSOR = {"ape": "position_bias", "wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "norm.weight": "kv_norm.weight"}
LAYER_NAMES = {
  "attn.attn_sink": "self_attn.sinks",
  "attn.wq_a.weight": "self_attn.q_a_proj.weight",
  "attn.q_norm.weight": "self_attn.q_a_norm.weight",
  "attn.wq_b.weight": "self_attn.q_b_proj.weight",
  "attn.wkv.weight": "self_attn.kv_proj.weight",
  "attn.norm.weight": "self_attn.kv_norm.weight",
  "attn.wo_a.weight": "self_attn.o_a_proj.weight",
  "attn.wo_b.weight": "self_attn.o_b_proj.weight",
  **{f"attn.compressor.{k}": f"self_attn.compressor.{v}" for k, v in _COMPRESSOR.items()},
  **{f"attn.indexer.compressor.{k}": f"self_attn.compressor.indexer.{v}" for k, v in _COMPRESSOR.items()},
  "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
  "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
  "attn_norm.weight": "input_layernorm.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  **{f"hc_{a}_{k}": f"{a}_hc.{k}" for a in ("attn", "ffn") for k in ("fn", "base", "scale")},
  "ffn.gate.weight": "mlp.gate.weight",
  "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
  "ffn.gate.tid2eid": "mlp.gate.tid2eid",
  "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
  "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
  "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
GLOBAL_NAMES = {  # both spellings read; the first is written
  "model.embed_tokens.weight": ("model.embed_tokens.weight", "embed.weight"),
  "model.norm.weight": ("model.norm.weight", "norm.weight"),
  "lm_head.weight": ("head.weight", "lm_head.weight"),
  "model.hc_head.hc_fn": ("model.hc_head.hc_fn", "hc_head_fn"),
  "model.hc_head.hc_base": ("model.hc_head.hc_base", "hc_head_base"),
  "model.hc_head.hc_scale": ("model.hc_head.hc_scale", "hc_head_scale"),
}


def _layer_name(name: str) -> tuple[str, str] | None:
  """'[model.]layers.<i>.<rest>' -> ('model.layers.<i>.', rest), else None."""
  parts = name.removeprefix("model.").split(".", 2)
  if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
    return f"model.layers.{parts[1]}.", parts[2]
  return None


def module_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A V4 checkpoint's tensors under transformers' module names: renamed, each layer's experts (ffn.experts.<j>.w1,
  w3, w2) fused into gate_up_proj [N, 2I, E] and down_proj [N, E, I]. Names it does not know pass unchanged (the
  conversion then reports them unused)."""
  out, experts = {}, {}
  renamed_globals = {spelling: ours for ours, spellings in GLOBAL_NAMES.items() for spelling in spellings}
  for name, value in tensors.items():
    layer = _layer_name(name)
    if name in renamed_globals:
      out[renamed_globals[name]] = value
    elif layer and layer[1] in LAYER_NAMES:
      out[layer[0] + LAYER_NAMES[layer[1]]] = value
    elif layer and layer[1].startswith("ffn.experts.") and layer[1].count(".") == 4:
      _, _, j, w, _ = layer[1].split(".")
      if j.isdigit() and w in ("w1", "w2", "w3"):
        experts.setdefault(layer[0], {}).setdefault(w, {})[int(j)] = value
        continue
      out[name] = value
    else:
      out[name] = value
  for prefix, ws in experts.items():
    stacked = {w: np.stack([per[j] for j in sorted(per)]) for w, per in ws.items()}
    if set(stacked) != {"w1", "w2", "w3"} or len({len(v) for v in stacked.values()}) != 1:
      raise ConfigError(f"layer '{prefix}' holds its experts' w1, w2 and w3 for different experts; the checkpoint is incomplete: re-download it")
    out[prefix + "mlp.experts.gate_up_proj"] = np.concatenate([stacked["w1"], stacked["w3"]], axis=1)
    out[prefix + "mlp.experts.down_proj"] = stacked["w2"]
  return out


def checkpoint_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """transformers' module names -> the checkpoint's (as transformers writes them): module_names' inverse."""
  inverse = {v: k for k, v in LAYER_NAMES.items()}
  out = {}
  for name, value in tensors.items():
    layer = _layer_name(name)
    if name in GLOBAL_NAMES:
      out[GLOBAL_NAMES[name][0]] = value
    elif layer and layer[1] == "mlp.experts.gate_up_proj":
      width = value.shape[1] // 2
      for j in range(value.shape[0]):
        out[f"{layer[0]}ffn.experts.{j}.w1.weight"], out[f"{layer[0]}ffn.experts.{j}.w3.weight"] = value[j, :width], value[j, width:]
    elif layer and layer[1] == "mlp.experts.down_proj":
      out.update({f"{layer[0]}ffn.experts.{j}.w2.weight": value[j] for j in range(value.shape[0])})
    else:
      out[layer[0] + inverse[layer[1]] if layer and layer[1] in inverse else name] = value
  return out
