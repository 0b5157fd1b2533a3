"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464): Qwen3-Next's linear attention, a token mixer whose
decode state has a fixed size.

Per token t and value head h (served by key head h // (H_v / H_k)), from x_t [E]:

    q_t, k_t, v_t = SiLU(causal depthwise conv_K(x W_qkv))_t      the window holds K tokens of t's document
    q_t, k_t      = q_t / |q_t|, k_t / |k_t|                       (L2, eps 1e-6 inside the root)
    g_t    = -exp(A_log) softplus(x_t W_a + dt_bias)              log decay, <= 0
    beta_t = sigmoid(x_t W_b)                                       write strength
    S_t    = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T      [d_k, d_v], float32
    o_t    = S_t^T q_t / sqrt(d_k)
    y_t    = W_out (RMSNorm(o_t) w * SiLU(x_t W_z))                  the gated norm, per value head

Two forms compute the delta rule. `recurrent_delta_rule` runs the recurrence token by token (decode). The chunked
form (`chunked_delta_rule`, training and prefill) cuts the sequence into chunks of C tokens: inside a chunk the
writes u_j obey a unit lower-triangular system (I + A) U = beta V - diag(beta Gamma) K S_0 with
A_jl = beta_j (Gamma_j / Gamma_l) k_j . k_l (l < j) and Gamma_j the decay from the chunk's start (the WY/UT
transform), solved for all chunks at once by the inverse of I + A (`unit_lower_inverse`, matmuls only); a jax.lax.scan over chunks then carries S from chunk to chunk:

    o_i = Gamma_i q_i^T S_0 + sum_{j <= i} (Gamma_i / Gamma_j) (q_i . k_j) u_j
    S_C = Gamma_C S_0 + sum_j (Gamma_C / Gamma_j) k_j u_j^T

Packed rows: a document starts where the segment id changes to a nonzero id. There the state S and the
convolution window restart from zero (the ratios Gamma_i / Gamma_j across a start are 0). Segment id 0 marks
padding: it neither decays nor writes the state (g = 0, beta = 0), so a right-padded prompt's state is that of
its last real token.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.sharding import Rules, constrain
from maxtext.platform import Policy

L2_EPS = 1e-6  # inside the root of q / |q| and k / |k| (as FLA and Hugging Face)


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetSpec:
  """One Gated DeltaNet layer (maxtext.models.specs builds it)."""

  emb_dim: int
  num_key_heads: int  # H_k: query and key heads
  num_value_heads: int  # H_v: value (and output) heads, a multiple of H_k
  key_head_dim: int  # d_k
  value_head_dim: int  # d_v
  conv_kernel: int = 4  # K: taps of the causal depthwise convolution over q, k, v
  chunk_size: int = 64  # C: tokens per chunk of the chunked form
  norm_epsilon: float = 1e-6  # the gated output norm's epsilon
  split_projections: bool = False  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3.5) instead of in_proj_qkvz, in_proj_ba
  rules: Rules = ()  # logical_axis_rules

  def __post_init__(self):
    if self.num_value_heads % self.num_key_heads:
      raise ValueError(f"Gated DeltaNet: {self.num_value_heads} value heads are not a multiple of {self.num_key_heads} key heads")
    if self.conv_kernel < 1 or self.chunk_size < 1:
      raise ValueError(f"Gated DeltaNet: conv_kernel ({self.conv_kernel}) and chunk_size ({self.chunk_size}) must be >= 1")

  @property
  def group(self) -> int:
    """Value heads per key head."""
    return self.num_value_heads // self.num_key_heads

  @property
  def conv_channels(self) -> int:
    """Channels of the convolution: q, k and v of all heads, [H_k d_k | H_k d_k | H_v d_v]."""
    return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

  def state_bytes(self, batch: int, conv_dtype: jnp.dtype) -> int:
    """Bytes of one layer's decode state for `batch` rows: independent of the sequence length."""
    conv = batch * (self.conv_kernel - 1) * self.conv_channels * jnp.dtype(conv_dtype).itemsize
    return conv + batch * self.num_value_heads * self.key_head_dim * self.value_head_dim * 4


class GatedDeltaNetState(NamedTuple):
  """One layer's decode state (a pytree)."""

  conv: jax.Array  # [B, K - 1, channels]: the convolution's last K - 1 inputs (compute dtype)
  recurrent: jax.Array  # [B, H_v, d_k, d_v]: S, float32


def l2_normalize(x: jax.Array) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def document_index(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
  """[B, S] int32: the documents started in the row up to each token (0 until the first start after position 0).

  A document starts where the segment id changes to a nonzero id; padding (0) stays in the document before it.
  """
  if segment_ids is None:
    return jnp.zeros((batch, length), jnp.int32)
  starts = (segment_ids[:, 1:] != segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
  return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.cumsum(starts, axis=1, dtype=jnp.int32)], axis=1)


def causal_conv(x: jax.Array, weight: jax.Array, doc: jax.Array, window: jax.Array | None, last: jax.Array) -> tuple[jax.Array, jax.Array]:
  """SiLU(depthwise causal convolution) of x [B, S, C] with weight [K, C] (tap K - 1 on the current token), float32.

  Taps reach only tokens of the same document (doc [B, S]); before position 0 they read `window` [B, K - 1, C]
  (the previous call's inputs; zeros if None), which belongs to document 0. -> (y [B, S, C] float32, the new
  window: the K - 1 inputs up to token `last` [B] within its document, zeros elsewhere).
  """
  b, s, c = x.shape
  taps = weight.shape[0]
  if window is None:
    window = jnp.zeros((b, taps - 1, c), x.dtype)
  full = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K - 1 + S, C]
  full_doc = jnp.concatenate([jnp.zeros((b, taps - 1), doc.dtype), doc], axis=1)
  w = weight.astype(jnp.float32)
  y = jnp.zeros((b, s, c), jnp.float32)
  for i in range(taps):  # tap i reads the token K - 1 - i steps back
    same = (full_doc[:, i : i + s] == doc)[..., None]
    y = y + jnp.where(same, full[:, i : i + s].astype(jnp.float32), 0.0) * w[i]
  rows = jnp.arange(b)
  index = last[:, None] + 1 + jnp.arange(taps - 1)[None, :]  # the positions last - K + 2 .. last, shifted by K - 1
  keep = full_doc[rows[:, None], index] == doc[rows, last][:, None]
  new_window = jnp.where(keep[..., None], full[rows[:, None], index], 0).astype(x.dtype)
  return jax.nn.silu(y), new_window


def _dot(spec: str, a: jax.Array, b: jax.Array, precision: jax.lax.Precision | None) -> jax.Array:
  return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def unit_lower_inverse(a: jax.Array, precision: jax.lax.Precision | None = None) -> jax.Array:
  """(I + a)^-1 for a strictly lower-triangular a [..., C, C], in float32, by matmuls alone.

  The inverses of the diagonal blocks double in size each round (1, 2, 4, ... up to C padded to a power of two):
  [[T11, 0], [A21, T22]]^-1 has T11, T22 on its diagonal and -T22 A21 T11 below it. Batched matmuls on every
  platform, and none of the CPU LAPACK triangular solver's nested thread-pool work, which deadlocks the executions
  of simulated multi-device CPU meshes (`--xla_force_host_platform_device_count`) whose collectives wait on it.
  """
  c = a.shape[-1]
  size = 1 << max(c - 1, 0).bit_length()
  a = jnp.pad(a.astype(jnp.float32), [(0, 0)] * (a.ndim - 2) + [(0, size - c), (0, size - c)])
  lead = a.shape[:-2]
  inverse = jnp.ones((*lead, size, 1, 1), jnp.float32)  # the diagonal blocks' inverses, [..., blocks, m, m]
  m = 1
  while m < size:
    blocks = a.reshape(*lead, size // m, m, size // m, m)
    below = jnp.moveaxis(jnp.diagonal(blocks, offset=-1, axis1=-4, axis2=-2), -1, -3)[..., ::2, :, :]  # A21 of each pair
    t11, t22 = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
    t21 = -_dot("...ij,...jk->...ik", _dot("...ij,...jk->...ik", t22, below, precision), t11, precision)
    top = jnp.concatenate([t11, jnp.zeros_like(t11)], axis=-1)
    inverse = jnp.concatenate([top, jnp.concatenate([t21, t22], axis=-1)], axis=-2)
    m *= 2
  return inverse[..., 0, :c, :c]


def chunked_delta_rule(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  doc: jax.Array,
  chunk: int,
  initial: jax.Array | None = None,
  precision: jax.lax.Precision | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The gated delta rule by chunks (module docstring), in float32.

  q, k [B, S, H, d_k] (per value head, q already scaled), v [B, S, H, d_v], g, beta [B, S, H], doc [B, S]
  (`document_index`), initial state [B, H, d_k, d_v] or None (zeros; it belongs to document 0).
  -> (o [B, S, H, d_v], final state [B, H, d_k, d_v]).
  """
  f32 = jnp.float32
  b, s, h, dk = q.shape
  dv = v.shape[-1]
  pad = -s % chunk
  n = (s + pad) // chunk

  def chunks(x: jax.Array) -> jax.Array:  # [B, S, H, ...] -> [B, N, H, C, ...]; padding neither decays nor writes
    x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 2, 3)

  q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
  doc = jnp.pad(doc, [(0, 0), (0, pad)], mode="edge").reshape(b, n, chunk)
  doc_before = jnp.concatenate([jnp.zeros((b, 1), doc.dtype), doc[:, :-1, -1]], axis=1)  # the document each chunk's incoming state belongs to
  carried = (doc == doc_before[..., None])[:, :, None]  # [B, N, 1, C]: the incoming state reaches token i
  cum = jnp.cumsum(g, axis=-1)  # [B, N, H, C]: log Gamma_i
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  same = (doc[..., :, None] == doc[..., None, :]) & causal  # [B, N, C, C]
  same = same[:, :, None]
  diff = cum[..., :, None] - cum[..., None, :]
  ratio = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)  # Gamma_i / Gamma_j within a document, i >= j
  gamma = jnp.where(carried, jnp.exp(cum), 0.0)  # [B, N, H, C]
  k_beta = k * beta[..., None]
  strict = ratio * (1.0 - jnp.eye(chunk, dtype=f32))
  inverse = unit_lower_inverse(_dot("...id,...jd->...ij", k_beta, k, precision) * strict, precision)  # (I + A)^-1
  rhs = jnp.concatenate([v * beta[..., None], k_beta * gamma[..., None]], axis=-1)
  solved = _dot("...ij,...jd->...id", inverse, rhs, precision)
  u, w = solved[..., :dv], solved[..., dv:]  # writes before the incoming state's share, and that share's keys
  intra = _dot("...id,...jd->...ij", q, k, precision) * ratio
  q_state = q * gamma[..., None]
  last_doc = doc[..., -1:]
  tail = jnp.where((doc == last_doc)[:, :, None], jnp.exp(cum[..., -1:] - cum), 0.0)  # Gamma_C / Gamma_j
  k_tail = k * tail[..., None]
  chunk_decay = gamma[..., -1]  # [B, N, H]

  def step(state, xs):
    u_c, w_c, q_c, intra_c, k_c, decay_c = xs
    written = u_c - _dot("bhck,bhkv->bhcv", w_c, state, precision)
    out = _dot("bhck,bhkv->bhcv", q_c, state, precision) + _dot("bhij,bhjv->bhiv", intra_c, written, precision)
    state = state * decay_c[..., None, None] + _dot("bhck,bhcv->bhkv", k_c, written, precision)
    return state, out

  state = jnp.zeros((b, h, dk, dv), f32) if initial is None else initial.astype(f32)
  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (u, w, q_state, intra, k_tail, chunk_decay))
  state, out = jax.lax.scan(step, state, xs)  # out [N, B, H, C, d_v]
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :s]
  return jnp.moveaxis(out, 1, 2), state


def recurrent_delta_rule(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  doc: jax.Array,
  initial: jax.Array | None = None,
  precision: jax.lax.Precision | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The gated delta rule token by token (the decode form); arguments and result as `chunked_delta_rule`."""
  f32 = jnp.float32
  b, s, h, dk = q.shape
  dv = v.shape[-1]
  doc_before = jnp.concatenate([jnp.zeros((b, 1), doc.dtype), doc[:, :-1]], axis=1)
  restart = doc != doc_before  # [B, S]: a document starts here: the state restarts from zero

  def step(state, xs):
    q_t, k_t, v_t, g_t, beta_t, restart_t = xs
    state = jnp.where(restart_t[:, None, None, None], 0.0, state * jnp.exp(g_t)[..., None, None])
    predicted = _dot("bhk,bhkv->bhv", k_t, state, precision)
    state = state + k_t[..., :, None] * ((v_t - predicted) * beta_t[..., None])[..., None, :]
    return state, _dot("bhk,bhkv->bhv", q_t, state, precision)

  state = jnp.zeros((b, h, dk, dv), f32) if initial is None else initial.astype(f32)
  xs = tuple(jnp.moveaxis(x.astype(f32), 1, 0) for x in (q, k, v, g, beta)) + (jnp.moveaxis(restart, 1, 0),)
  state, out = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(out, 0, 1), state


class GatedDeltaNet(nnx.Module):
  """The Gated DeltaNet token mixer (module docstring). Parameters as Hugging Face's Qwen3NextGatedDeltaNet:

  in_proj_qkvz [E, H_k, 2 d_k + 2 (H_v / H_k) d_v] (per key head: q, k, then its value heads' v, then their z),
  in_proj_ba [E, H_k, 2 H_v / H_k] (per key head: its value heads' b, then their a), conv [K, channels],
  A_log and dt_bias [H_v], norm.scale [d_v] (applied as is, not 1 + w), out_proj [H_v, d_v, E].

  With spec.split_projections (Qwen3_5GatedDeltaNet) four projections replace the two fused ones: in_proj_qkv
  [E, channels] (all heads' q, then k, then v: the convolution's channel order), in_proj_z [E, H_v, d_v],
  in_proj_b and in_proj_a [E, H_v].
  """

  def __init__(self, spec: GatedDeltaNetSpec, *, policy: Policy, rngs: nnx.Rngs):
    self.spec = spec
    self.policy = policy
    e, hk, dk, r, dv = spec.emb_dim, spec.num_key_heads, spec.key_head_dim, spec.group, spec.value_head_dim
    kw = dense_kwargs(policy, rngs)
    params = policy.dtypes.params
    if spec.split_projections:
      hv = spec.num_value_heads
      self.in_proj_qkv = DenseGeneral((e,), (spec.conv_channels,), ("embed", "mlp"), **kw)
      self.in_proj_z = DenseGeneral((e,), (hv, dv), ("embed", "heads", "head_dim"), **kw)
      self.in_proj_b = DenseGeneral((e,), (hv,), ("embed", "heads"), **kw)
      self.in_proj_a = DenseGeneral((e,), (hv,), ("embed", "heads"), **kw)
    else:
      self.in_proj_qkvz = DenseGeneral((e,), (hk, 2 * dk + 2 * r * dv), ("embed", "kv_heads", "head_dim"), **kw)
      self.in_proj_ba = DenseGeneral((e,), (hk, 2 * r), ("embed", "kv_heads", None), **kw)
    bound = 1.0 / math.sqrt(spec.conv_kernel)  # torch's Conv1d init (fan-in K for a depthwise filter)
    conv = jax.random.uniform(rngs.params(), (spec.conv_kernel, spec.conv_channels), jnp.float32, -bound, bound)
    self.conv = nnx.Param(conv.astype(params), logical_axes=(None, None))
    # A in [1, 16] and dt in [1e-3, 0.1] log-uniform, dt_bias = softplus^-1(dt) (Mamba2 / FLA's initialisation)
    a = jax.random.uniform(rngs.params(), (spec.num_value_heads,), jnp.float32, 1.0, 16.0)
    self.A_log = nnx.Param(jnp.log(a).astype(params), logical_axes=("heads",))
    dt = jnp.exp(jax.random.uniform(rngs.params(), (spec.num_value_heads,), jnp.float32, math.log(1e-3), math.log(0.1)))
    self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(params), logical_axes=("heads",))
    self.norm = RMSNorm(dv, spec.norm_epsilon, dtype=jnp.float32, weight_dtype=params, logical_axis="head_dim")
    self.out_proj = DenseGeneral((spec.num_value_heads, dv), (e,), ("heads", "head_dim", "embed"), **kw)

  def init_state(self, batch: int) -> GatedDeltaNetState:
    """The empty decode state of `batch` rows."""
    s = self.spec
    conv = jnp.zeros((batch, s.conv_kernel - 1, s.conv_channels), self.policy.dtypes.compute)
    return GatedDeltaNetState(conv, jnp.zeros((batch, s.num_value_heads, s.key_head_dim, s.value_head_dim), jnp.float32))

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None) -> jax.Array:
    """Training: x [B, S, E] -> [B, S, E] by the chunked form, each document from an empty state."""
    return self.mix(x, segment_ids, None, recurrent=False, adapter_ids=adapter_ids)[0]

  def prefill(self, x: jax.Array, segment_ids: jax.Array | None = None, adapter_ids: jax.Array | None = None) -> tuple[jax.Array, GatedDeltaNetState]:
    """Prefill: -> (output [B, S, E], the state after each row's last nonzero-segment token), by the chunked form."""
    return self.mix(x, segment_ids, None, recurrent=False, adapter_ids=adapter_ids)

  def decode_step(self, x: jax.Array, state: GatedDeltaNetState, adapter_ids: jax.Array | None = None) -> tuple[jax.Array, GatedDeltaNetState]:
    """Decode: x [B, S, E] (S = 1 per generated token) continuing `state` -> (output, state), token by token."""
    return self.mix(x, None, state, recurrent=True, adapter_ids=adapter_ids)

  def project(self, x: jax.Array, adapter_ids: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [B, S, E] -> (the convolution's input [B, S, channels] in [q | k | v] order, z [B, S, H_v, d_v],
    b and a [B, S, H_v] float32), from the fused per-key-head projections or the split ones."""
    spec = self.spec
    b, s, _ = x.shape
    hk, dk, hv, dv, r = spec.num_key_heads, spec.key_head_dim, spec.num_value_heads, spec.value_head_dim, spec.group
    if spec.split_projections:
      mixed = checkpoint_name(self.in_proj_qkv(x, adapter_ids), "query_proj")
      z = self.in_proj_z(x, adapter_ids)
      return mixed, z, self.in_proj_b(x, adapter_ids).astype(jnp.float32), self.in_proj_a(x, adapter_ids).astype(jnp.float32)
    qkvz = checkpoint_name(self.in_proj_qkvz(x, adapter_ids), "query_proj")  # [B, S, H_k, 2 d_k + 2 r d_v]
    ba = self.in_proj_ba(x, adapter_ids).astype(jnp.float32)  # [B, S, H_k, 2 r]
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    mixed = jnp.concatenate([q.reshape(b, s, hk * dk), k.reshape(b, s, hk * dk), v.reshape(b, s, hv * dv)], axis=-1)
    return mixed, z.reshape(b, s, hv, dv), ba[..., :r].reshape(b, s, hv), ba[..., r:].reshape(b, s, hv)

  def mix(
    self, x: jax.Array, segment_ids: jax.Array | None, state: GatedDeltaNetState | None, *, recurrent: bool, adapter_ids: jax.Array | None = None
  ) -> tuple[jax.Array, GatedDeltaNetState]:
    """x [B, S, E] from `state` (None: empty) -> (y [B, S, E], state); recurrent picks the token-by-token form.
    adapter_ids: each row's (or token's) LoRA slot, for projections lora_module_path adapts."""
    spec, rules = self.spec, self.spec.rules
    precision = self.policy.dtypes.precision
    b, s, _ = x.shape
    hk, dk, hv, dv, r = spec.num_key_heads, spec.key_head_dim, spec.num_value_heads, spec.value_head_dim, spec.group
    mixed, z, b_logit, a = self.project(x, adapter_ids)
    doc = document_index(segment_ids, b, s)
    real = jnp.ones((b, s), bool) if segment_ids is None else segment_ids != 0
    last = jnp.max(jnp.where(real, jnp.arange(s)[None, :], 0), axis=1)
    conv_out, window = causal_conv(mixed, self.conv[...], doc, None if state is None else state.conv, last)
    q, k, v = jnp.split(conv_out, [hk * dk, 2 * hk * dk], axis=-1)
    q = jnp.repeat(l2_normalize(q.reshape(b, s, hk, dk)) * dk**-0.5, r, axis=2)  # value head h reads key head h // r
    k = jnp.repeat(l2_normalize(k.reshape(b, s, hk, dk)), r, axis=2)
    v = v.reshape(b, s, hv, dv)
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None), rules)
    k = constrain(k, ("activation_batch", "activation_length", "activation_heads", None), rules)
    v = constrain(v, ("activation_batch", "activation_length", "activation_heads", None), rules)
    beta = jax.nn.sigmoid(b_logit)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
    g, beta = jnp.where(real[..., None], g, 0.0), jnp.where(real[..., None], beta, 0.0)  # padding leaves the state alone
    initial = None if state is None else state.recurrent
    if recurrent:
      o, final = recurrent_delta_rule(q, k, v, g, beta, doc, initial, precision)
    else:
      o, final = chunked_delta_rule(q, k, v, g, beta, doc, spec.chunk_size, initial, precision)
    o = checkpoint_name(o, "context")
    gate = jax.nn.silu(z.astype(jnp.float32))
    y = (self.norm(o) * gate).astype(self.policy.dtypes.compute)
    return checkpoint_name(self.out_proj(y, adapter_ids), "out_proj"), GatedDeltaNetState(window, final)
