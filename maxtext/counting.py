"""Parameter counts and training FLOPs, read off the model's abstract parameter tree.

The model is built with nnx.eval_shape (shapes only, no memory; well under a second for a full-size model once JAX
is warm), so the counts follow the built model exactly. FLOPs come from each parameter's size, whether it trains
(maxtext.train.trainable) and where it sits in its layer's data flow (DecoderLayer.branches), plus a few
architectural numbers the tree does not hold: the tokens per step, the attention scores' heads, widths and
per-layer windows (from the family's layer pattern: each layer's kind), num_experts_per_tok, and mHC's stream
mixing and Sinkhorn iterations.

Used by metrics (TFLOP/s/device, MFU), AOT reports, preflight and the model-file tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from flax import nnx

from maxtext.models import registry
from maxtext.models.family import LayerKind

if TYPE_CHECKING:
  from maxtext.config import MaxTextConfig

RESIDUAL_AXIS = "embed"  # logical axis of the residual width: a kernel ending on it writes its branch's output
EXPERT_AXIS = "exp"  # routed experts' stacking axis: a token reaches num_experts_per_tok of them
VOCAB_AXIS = "vocab"  # the embedding table and the output kernel
SINKHORN_FLOPS_PER_ENTRY = 4  # one log-domain normalisation: subtract the max, exp, sum, subtract the log-sum
_MODELS: dict[str, _Tree] = {}  # abstract models by config, so one run builds each once
_CACHED_MODELS = 8


@dataclasses.dataclass(frozen=True)
class _Tree:
  """The abstract model, its layer pattern, and one abstract decoder layer of each structure in it."""

  model: Any
  kinds: tuple[LayerKind, ...]
  layers: dict[LayerKind, Any]  # by LayerKind.structure
  flops: list = dataclasses.field(default_factory=list)  # _model_flops' result, once computed


def _tree(config: MaxTextConfig) -> _Tree:
  """config's abstract model, built once (the few last configs are kept)."""
  key = config.model_dump_json()
  if key not in _MODELS:
    if len(_MODELS) >= _CACHED_MODELS:
      _MODELS.pop(next(iter(_MODELS)))
    _MODELS[key] = _build(config)
  return _MODELS[key]


def _build_policy(config: MaxTextConfig) -> Any:
  """The platform policy the counts assume (quantization left out, see _build)."""
  from maxtext import platform

  return dataclasses.replace(platform.resolve(config), quantization=None)


def _build(config: MaxTextConfig) -> _Tree:
  """Counting's abstract model: the architecture's weights in weight_dtype (quantization, a storage and matmul
  format, is left out: a stored-quantized kernel packs its values and adds scales)."""
  from maxtext import models
  from maxtext.models import specs
  from maxtext.models.decoder_layer import DecoderLayer

  policy = _build_policy(config)
  family = registry.get(config.decoder_block)

  def layer(kind: LayerKind) -> Any:
    return nnx.eval_shape(lambda: DecoderLayer(specs.layer(config, family, kind), policy=policy, rngs=nnx.Rngs(0)))

  kinds = family.kinds(config)
  return _Tree(models.abstract_model(config, policy), kinds, {k: layer(k) for k in dict.fromkeys(k.structure for k in kinds)})


def _variables(module: Any) -> list[nnx.Variable]:
  return [v for _, v in nnx.to_flat_state(nnx.state(module))]


def _axes(v: nnx.Variable) -> tuple:
  return tuple(v.get_metadata().get("logical_axes") or ())


def _size(v: nnx.Variable, config: MaxTextConfig, active_only: bool = False) -> int:
  """Entries of v; active_only: those a token reaches (num_experts_per_tok of a routed expert stack)."""
  size = math.prod(v.shape)
  if active_only and EXPERT_AXIS in _axes(v):
    return size // v.shape[_axes(v).index(EXPERT_AXIS)] * config.num_experts_per_tok
  return size


def _count(variables: list[nnx.Variable], config: MaxTextConfig, active_only: bool = False) -> int:
  return sum(_size(v, config, active_only) for v in variables)


def _modules_of(model: Any, kind: type) -> list[tuple[tuple, Any]]:
  return [(tuple(path), m) for path, m in nnx.iter_modules(model) if isinstance(m, kind)]


def _mtp_blocks(model: Any) -> list[Any]:
  from maxtext.models.mtp import MTPBlock

  return [m for _, m in _modules_of(model, MTPBlock)]


def param_count(config: MaxTextConfig, include_embedding: bool = True, active_only: bool = False) -> int:
  """Number of model parameters: the entries of the built model's state (tied embedding and output counted once).

  include_embedding=False leaves out the tensors with a vocab axis (the token embedding and a separate output
  projection); active_only counts num_experts_per_tok routed experts per MoE layer instead of all of them.
  """
  variables = _variables(_tree(config).model)
  if not include_embedding:
    variables = [v for v in variables if VOCAB_AXIS not in _axes(v)]
  return _count(variables, config, active_only)


def _layer(config: MaxTextConfig, dense: bool) -> Any:
  """The first layer with a dense MLP (dense) or with experts (not dense); the last layer when the model has none."""
  tree = _tree(config)
  kind = next((k for k in tree.kinds if (k.ffn == "dense") == dense), tree.kinds[-1])
  return tree.layers[kind.structure]


def params_per_layer(config: MaxTextConfig, active_only: bool = False, dense: bool = False) -> int:
  """Parameters of one decoder layer with experts (a model's only kind when it has none); dense=True: one with a
  dense MLP (DeepSeek's first_num_dense_layers)."""
  return _count(_variables(_layer(config, dense)), config, active_only)


def mhc_params_per_layer(config: MaxTextConfig) -> int:
  """mHC parameters of one decoder layer (its two connections); 0 when mhc_expansion_rate is 1."""
  return sum(_count(_variables(branch[0]), config) for branch in _layer(config, False).branches())


def lora_params_per_layer(config: MaxTextConfig, dense: bool = False) -> int:
  """LoRA adapter parameters of one decoder layer (0 without LoRA)."""
  from maxtext.layers.lora import LoRAParam

  return _count([v for v in _variables(_layer(config, dense)) if isinstance(v, LoRAParam)], config)


def mtp_params(config: MaxTextConfig, active_only: bool = False) -> int:
  """Parameters of the multi-token-prediction modules (their embedding and output head are the main model's)."""
  return sum(_count(_variables(block), config, active_only) for block in _mtp_blocks(_tree(config).model))


def attended_keys(config: MaxTextConfig) -> int:
  """Keys each query attends to, summed over layers: min(seq, window) on sliding-window layers, seq elsewhere."""
  return sum(_keys(config))


def _keys(config: MaxTextConfig) -> list[int]:
  """Keys per query of each decoder layer, from its kind's window (0 = full attention); a Gated DeltaNet layer's
  chunked form scores each token against the tokens of its chunk, min(seq, gdn_chunk_size) (its state products,
  about 6 d_k d_v per token and value head, are not counted)."""
  seq = config.max_target_length
  out = []
  for kind in registry.get(config.decoder_block).kinds(config):
    if kind.mixer == "gated_deltanet":
      out.append(min(seq, config.gdn_chunk_size))
    elif kind.mixer == "mla_sparse" and _sparse_gather(config):
      out.append(min(seq, config.indexer_topk))
    else:
      out.append(min(seq, kind.window or kind.chunk) if kind.window or kind.chunk else seq)  # a chunk bounds the keys as a window does
  return out


def _sparse_gather(config: MaxTextConfig) -> bool:
  """Does DeepSeek Sparse Attention train through its gather path (only each query's indexer_topk keys, in MLA's
  absorbed form)? The platform policy picks gather; the dense warm-up and a LoRA adapter on wkv_b take the masked
  form, which scores every visible key (maxtext.layers.mla_sparse). The indexer's own scores: _indexer_flops."""
  from maxtext.models.mixer_specs import indexer_warmup

  if _build_policy(config).sparse_attention != "gather" or indexer_warmup(config):
    return False
  layers = [m for _, m in _tree(config).layers.items() if hasattr(getattr(m, "attention", None), "wkv_b")]
  return all(m.attention.wkv_b.lora is None for m in layers)


def attention_width(c: MaxTextConfig, mixer: str = "attention") -> float:
  """Mean of the query-key and value widths per head of a token mixer: head_dim, or (nope + rope + v) / 2 for MLA; for
  Gated DeltaNet (d_k + d_v) / 2 scaled by its value heads per query head (the scores count num_query_heads heads)."""
  if mixer == "gated_deltanet":
    return (c.gdn_key_head_dim + c.gdn_value_head_dim) / 2 * c.gdn_num_value_heads / c.num_query_heads
  if mixer == "mla_sparse" and _sparse_gather(c):  # the absorbed form: scores over the latent + rope key, values the latent
    return (2 * c.kv_lora_rank + c.qk_rope_head_dim) / 2
  if mixer in ("mla", "mla_sparse"):  # mla_sparse's masked form and dense warm-up score every visible key
    return (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2
  return c.head_dim


def _matmul(params: int, weight_grad: bool, input_grad: bool) -> int:
  """FLOPs per token of a weight of `params` entries: forward 2, input gradient 2, weight gradient 2."""
  return 2 * params * (1 + int(weight_grad) + int(input_grad))


def mhc_mixing_flops(connection: Any, input_grad: bool = True) -> int:
  """Training FLOPs per token of one mHC connection beyond its parameters' own (6 per entry, 4 without input_grad).

  With n streams of width E: stream mixing, forward sum_k H_pre[k] x_k (2nE), sum_k H_res[m,k] x_k (2n^2 E) and
  H_post[m] y (2nE); backward the H gradients (same), the gradient to y (2nE) and, with input_grad, to the streams
  (2nE + 2n^2 E). Sinkhorn: sinkhorn_iterations x 2 normalisations of n^2 entries at SINKHORN_FLOPS_PER_ENTRY each,
  plus the final exp; its backward twice that. Recomputation under remat is not counted (model FLOPs, as for every
  other layer).
  """
  n = connection.n
  e = math.prod(connection.norm_scale.shape) // n  # the norm spans the n streams
  mixing_forward = 2 * e * (2 * n + n * n)
  mixing = 2 * mixing_forward + 2 * n * e + (2 * e * (n + n * n) if input_grad else 0)
  sinkhorn = 3 * (2 * connection.sinkhorn_iterations * SINKHORN_FLOPS_PER_ENTRY * n * n + n * n)
  return mixing + sinkhorn


@dataclasses.dataclass(frozen=True)
class _Weight:
  """One parameter as the FLOPs see it: the entries a token uses, its stage in the layer (bottom to top), whether it
  trains, and whether its input gradient is needed whatever lies below (a LoRA B: its A trains)."""

  size: int
  stage: int
  trainable: bool
  fed_by_trainable: bool = False
  detached: bool = False  # reads stop_gradient inputs (the lightning indexer): never an input gradient, none below it


def _trains(config: MaxTextConfig) -> Any:
  """Predicate (variable, its path below some module) -> does the optimizer update it (maxtext.train.trainable)?"""
  from maxtext.train.trainable import trainable_filter

  predicate = nnx.filterlib.to_predicate(trainable_filter(config))
  return lambda v, path=(): bool(predicate(tuple(path), v))


def _params(module: Any, skip: list[tuple] = ()) -> list[nnx.Variable]:
  """module's nnx.Params, except those under the module paths in skip."""
  return [v for _, v in _named_params(module, skip)]


def _named_params(module: Any, skip: list[tuple] = ()) -> list[tuple[tuple, nnx.Variable]]:
  """(path below module, variable) of module's nnx.Params, except those under the module paths in skip."""
  flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
  return [(tuple(path), v) for path, v in flat if not any(tuple(path[: len(p)]) == p for p in skip)]


def _weights(module: Any, stage: int, output_stage: int, config: MaxTextConfig) -> list[_Weight]:
  """module's parameters: kernels (2+ axes) ending on the residual axis at output_stage (a branch's output), the
  rest at stage; a LoRA adapter at its kernel's stage (its B ends on the kernel's output axes); a lightning indexer's
  detached, with a weight gradient only when its KL loss is on (indexer_loss_scaling_factor > 0)."""
  from maxtext.layers.lora import LoRA, MultiLoRA
  from maxtext.layers.mla_sparse import Indexer

  trains = _trains(config)

  def at(v: nnx.Variable) -> int:
    axes = _axes(v)
    return output_stage if len(axes) >= 2 and axes[-1] == RESIDUAL_AXIS else stage

  adapters = _modules_of(module, (LoRA, MultiLoRA))
  indexers = _modules_of(module, Indexer)
  skip = [p for p, _ in adapters + indexers]
  weights = [_Weight(_size(v, config, True), at(v), trains(v, path)) for path, v in _named_params(module, skip)]
  learns = config.indexer_loss_scaling_factor > 0  # its KL is the indexer's only gradient
  for where, indexer in indexers:
    weights += [_Weight(_size(v, config), stage, learns and trains(v, where + path), detached=True) for path, v in _named_params(indexer)]
  for _, adapter in adapters:
    a, b = adapter.lora_a, adapter.lora_b
    weights += [_Weight(_size(a, config), at(b), trains(a)), _Weight(_size(b, config), at(b), trains(b), trains(a))]
  return weights


_ATTENTION_CORE = 2  # stages of a branch: 0 its connection, 1 its inputs, 2 the attention core, 3 its outputs
_BRANCH_STAGES = 4


@dataclasses.dataclass(frozen=True)
class _LayerFlops:
  weights: int  # training FLOPs per token of the layer's parameters (and mHC's mixing and Sinkhorn)
  forward: int  # forward FLOPs per token of its variables (2 per entry a token uses)
  attention_backward: bool  # whether its attention scores run backward (something below them trains)
  passes_gradients: bool  # whether a gradient leaves its top (it or something below it trains, a detached weight aside)


def _layer_flops(config: MaxTextConfig, layer: Any, below_trains: bool) -> _LayerFlops:
  """One decoder layer's FLOPs per token; below_trains: something below the layer trains (False only for the
  lowest layer of a LoRA run, whose embedding is frozen): otherwise no input gradient is computed below the
  layer's lowest trainable parameter."""
  weights, connections = [], []
  for i, (connection, pre_norm, body, post_norm) in enumerate(layer.branches()):
    base = _BRANCH_STAGES * i
    connections.append((base, connection, _weights(connection, base, base, config)))
    weights += _weights(pre_norm, base + 1, base + 1, config) if pre_norm is not None else []
    weights += _weights(body, base + 1, base + 3, config)
    weights += _weights(post_norm, base + 3, base + 3, config) if post_norm is not None else []
  every = weights + [w for _, _, ws in connections for w in ws]

  def needs_dx(stage: int) -> bool:
    return below_trains or any(w.trainable and not w.detached and w.stage < stage for w in every)

  total = sum(_matmul(w.size, w.trainable, not w.detached and (w.fed_by_trainable or needs_dx(w.stage))) for w in every)
  total += sum(mhc_mixing_flops(connection, needs_dx(stage)) for stage, connection, ws in connections if ws)
  forward = 2 * _count(_variables(layer), config, active_only=True)  # with a routing bias, which gradients do not train
  return _LayerFlops(total, forward, needs_dx(_ATTENTION_CORE), needs_dx(_BRANCH_STAGES * len(layer.branches())))


@dataclasses.dataclass(frozen=True)
class _ModelFlops:
  """FLOPs per token of the parameters (training and forward), and the attention scores' passes."""

  weights: int
  forward: int
  keys: list[int]  # keys per query of each attention (decoder layers, then MTP modules)
  widths: list[float]  # attention_width of each
  backward: list[bool]  # whether each runs backward
  forward_layers: int  # how many of them a plain forward pass runs (the MTP modules are training-only)


def _model_flops(config: MaxTextConfig) -> _ModelFlops:
  tree = _tree(config)
  if not tree.flops:
    tree.flops.append(_count_model_flops(config, tree))
  return tree.flops[0]


def _count_model_flops(config: MaxTextConfig, tree: _Tree) -> _ModelFlops:
  from maxtext.layers.embed import Embed
  from maxtext.models.decoder_layer import DecoderLayer
  from maxtext.models.mtp import MTPBlock

  c, trains = config, _trains(config)
  model = tree.model
  embeds = _modules_of(model, Embed)
  below = any(trains(v) for _, m in embeds for v in _params(m))  # a trainable embedding: the lowest layer passes gradients down
  skip = [p for p, _ in _modules_of(model, (DecoderLayer, MTPBlock))] + ([] if c.logits_via_embedding else [p for p, _ in embeds])
  skip += [("vision",)]  # counted per image (_vision_flops)
  head = _params(model, skip)  # final norm and the output matmul (the tied table: the embedding lookup itself is free)
  per_structure: dict[tuple[LayerKind, bool], _LayerFlops] = {}
  layers = []
  passes = below  # a gradient reaches the next layer's input from below
  for kind in tree.kinds:
    key = (kind.structure, passes)
    if key not in per_structure:
      per_structure[key] = _layer_flops(c, tree.layers[kind.structure], below_trains=passes)
    layers.append(per_structure[key])
    passes = layers[-1].passes_gradients
  head_flops = sum(_matmul(_size(v, c), trains(v), passes) for v in head)
  weights = sum(f.weights for f in layers) + head_flops
  for block in _mtp_blocks(model):
    inner = _modules_of(block, DecoderLayer)
    own = _params(block, [p for p, _ in inner])
    weights += sum(_matmul(_size(v, c), trains(v), passes) for v in own)
    mtp_layer = _layer_flops(c, inner[0][1], passes or any(trains(v) for v in own))
    weights += mtp_layer.weights + sum(_matmul(_size(v, c), trains(v), mtp_layer.passes_gradients) for v in head)
    layers.append(mtp_layer)
  forward = sum(f.forward for f in layers[: c.num_decoder_layers]) + sum(2 * _size(v, c) for v in head)
  keys = _keys(c) + [c.max_target_length] * c.mtp_num_layers
  widths = [attention_width(c, k.mixer) for k in tree.kinds] + [attention_width(c, tree.kinds[-1].mixer)] * c.mtp_num_layers  # MTP: built like the last layer
  return _ModelFlops(weights, forward, keys, widths, [f.attention_backward for f in layers], c.num_decoder_layers)


def training_flops_per_step(config: MaxTextConfig) -> float:
  """Model FLOPs of one optimizer step over the whole global batch (forward + backward), as they run.

  With T = global_batch_size_to_train_on x max_target_length tokens: T x the parameters' FLOPs per token (per
  weight entry a token uses: 2 forward, 2 for its gradient if it trains, 2 for its input's gradient if something
  below it trains; routed experts count num_experts_per_tok of num_experts; the output matmul once per output head,
  the main model's and each MTP module's) + causal attention scores, 2 T x keys x heads x attention_width forward
  and twice that backward per layer (and MTP module), where sliding-window layers see min(seq, window) keys.
  """
  c = config
  tokens = c.global_batch_size_to_train_on * c.max_target_length
  flops = _model_flops(c)
  scores = sum((3 if backward else 1) * _scores(c, tokens, k, w) for k, w, backward in zip(flops.keys, flops.widths, flops.backward))
  return float(tokens * flops.weights + scores + _indexer_flops(c, tokens, training=True) + _vision_flops(c, training=True))


def _scores(c: MaxTextConfig, tokens: int, keys: int, width: float) -> float:
  """Forward FLOPs of one layer's attention scores: 2 T x keys x heads x attention_width."""
  return 2 * tokens * keys * c.num_query_heads * width


def forward_flops_per_step(config: MaxTextConfig) -> float:
  """Model FLOPs of one forward pass over the global batch without gradients (a reference or scoring pass):
  2 per parameter entry a token uses (the embedding lookup excluded, the output matmul included; no MTP modules)
  plus the causal attention scores, 2 T x keys x heads x attention_width per layer."""
  c = config
  tokens = c.global_batch_size_to_train_on * c.max_target_length
  flops = _model_flops(c)
  scores = sum(_scores(c, tokens, k, w) for k, w in list(zip(flops.keys, flops.widths))[: flops.forward_layers])
  return float(tokens * flops.forward + scores + _indexer_flops(c, tokens, training=False) + _vision_flops(c, training=False))


def _indexer_flops(c: MaxTextConfig, tokens: int, training: bool) -> float:
  """DeepSeek Sparse Attention's lightning indexer in its mla_sparse layers (and, training, the MTP modules built
  like them), beyond its projections: its scores, 2 T x keys x indexer_n_heads x indexer_head_dim forward over every
  visible key in every path, twice that backward when its KL trains it (indexer_loss_scaling_factor > 0); and the
  KL's target, MLA's attention probabilities recomputed over every visible key from detached queries and keys
  (forward only, 2 T x keys x heads x (qk_nope + qk_rope)) in the dense warm-up and the masked path (the gather path's
  KL reuses the probabilities its attention computed)."""
  kinds = [k.mixer for k in _tree(c).kinds]
  layers = kinds.count("mla_sparse") + (c.mtp_num_layers if training and kinds[-1] == "mla_sparse" else 0)
  if not layers:
    return 0.0
  keys = c.max_target_length
  scores = 2 * tokens * keys * c.indexer_n_heads * c.indexer_head_dim
  learns = c.indexer_loss_scaling_factor > 0
  total = scores * (3 if training and learns else 1)
  if learns and not _sparse_gather(c):
    total += 2 * tokens * keys * c.num_query_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
  return float(layers * total)


def _vision_flops(config: MaxTextConfig, training: bool) -> float:
  """use_multimodal: the vision component's FLOPs per step over the images the compiled step encodes (every image
  slot of every row; maxtext.vision.flops). A frozen tower (freeze_vision_encoder_params, or LoRA) runs forward
  only: no weight gradients, no input gradients below the lowest trainable stage, no backward attention scores."""
  from maxtext.train.trainable import trainable_filter
  from maxtext.vision import flops as vision_flops

  vision = getattr(_tree(config).model, "vision", None)
  if vision is None:
    return 0.0
  c = config
  if c.dataset_type == "synthetic" and c.vision_encoder_block == "qwen3_vl":  # synthetic rows carry no images: the step runs no tower
    return 0.0
  cost = vision_flops.cost(vision.spec, c.max_target_length, c.max_patches_per_row_for_vit)
  if cost is None:
    return 0.0
  trains = nnx.filterlib.to_predicate(trainable_filter(c))
  total, below = 0, False
  for stage in cost.stages:
    module = vision
    for name in stage.path:
      module = getattr(module, name)
    prefix = ("vision", *stage.path)
    flat = [(prefix + tuple(path), v) for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
    stage_trains = any(trains(path, v) for path, v in flat)
    if training:
      total += stage.tokens * sum(_matmul(_size(v, c), trains(path, v), below) for path, v in flat)
    else:
      total += stage.tokens * 2 * sum(_size(v, c) for _, v in flat)
    below = below or stage_trains
  tower_trains = any(trains(("vision", "tower", *path), v) for path, v in nnx.to_flat_state(nnx.state(vision.tower, nnx.Param)))
  total += cost.score_flops * (3 if training and tower_trains else 1)
  return float(c.global_batch_size_to_train_on * cost.images_per_row * total)


def step_flops(config: MaxTextConfig) -> float:
  """Model FLOPs of one train step as the run's objective makes it: one training pass, plus DPO's reference forward;
  GRPO: num_iterations training passes plus the scoring forwards (old log-probabilities when num_iterations > 1,
  reference log-probabilities when grpo_beta > 0). GRPO's rollout decoding is not counted (its length varies)."""
  c = config
  if c.use_dpo:
    return training_flops_per_step(c) + forward_flops_per_step(c)
  if c.use_grpo:
    forwards = int(c.num_iterations > 1) + int(c.grpo_beta > 0)
    return c.num_iterations * training_flops_per_step(c) + forwards * forward_flops_per_step(c)
  return training_flops_per_step(c)


def flops_per_device_per_step(config: MaxTextConfig) -> float:
  """step_flops divided evenly over config.num_devices."""
  return step_flops(config) / config.num_devices
