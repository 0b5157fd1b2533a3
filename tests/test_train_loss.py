"""Loss: masking, z-loss and MoE aux against a hand computation; vocabulary tiling equals the plain loss and cuts peak memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.errors import ConfigError
from maxtext.layers.output_head import OutputHead
from maxtext.train import loss as loss_lib
from tests.test_train_helpers import tiny_config


class LinearHead:
  """hidden_states returns fixed hidden states; logits = hidden @ w in float32."""

  def __init__(self, hidden, w, aux=0.0, tiles=1):
    self.hidden, self.w, self.aux, self.tiles = hidden, w, aux, tiles

  def hidden_states(self, tokens, positions=None, segment_ids=None):
    return self.hidden, jnp.asarray(self.aux, jnp.float32)

  def forward_hidden(self, tokens, positions=None, segment_ids=None, adapter_ids=None, images=None):
    zero = jnp.zeros((), jnp.float32)
    return self.hidden, self.hidden, {"lb_loss": jnp.asarray(self.aux, jnp.float32), "dropped": zero, "load": jnp.zeros((1, 1)), "indexer_loss": zero}

  def output_head(self):
    return OutputHead(self.w, jnp.float32, vocab_tiles=self.tiles)


def _batch(targets, segmentation):
  t = jnp.asarray(targets, jnp.int32)
  seg = jnp.asarray(segmentation, jnp.int32)
  return {"inputs": t, "inputs_position": t * 0, "inputs_segmentation": seg, "targets": t, "targets_position": t * 0, "targets_segmentation": seg}


def test_masked_cross_entropy_and_z_loss_match_hand_computation():
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(2, 4, 5)).astype(np.float32)
  targets = [[1, 2, 3, 4], [0, 1, 2, 3]]
  seg = [[1, 1, 2, 0], [1, 0, 0, 0]]  # packed row with padding; second row mostly padding
  config = tiny_config(num_devices=1, z_loss_multiplier=1e-2)
  sums = loss_lib.loss_sums(LinearHead(jnp.asarray(hidden), jnp.eye(5), aux=0.25), _batch(targets, seg), config)

  xent = z = 0.0
  for b in range(2):
    for s in range(4):
      if seg[b][s]:
        lse = np.log(np.sum(np.exp(hidden[b, s].astype(np.float64))))
        xent += lse - hidden[b, s, targets[b][s]]
        z += 1e-2 * lse**2
  assert float(sums.weights) == 4
  np.testing.assert_allclose(float(sums.xent), xent, rtol=1e-5)
  np.testing.assert_allclose(float(sums.z_loss), z, rtol=1e-5)
  assert float(sums.aux) == 0.25


@pytest.fixture(scope="module")
def head():
  rng = np.random.default_rng(1)
  b, s, e, v = 4, 64, 32, 4096
  hidden = jnp.asarray(rng.normal(size=(b, s, e)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(e, v)) * 0.1, jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, size=(b, s)), jnp.int32)
  seg = jnp.asarray(rng.integers(0, 2, size=(b, s)), jnp.int32)
  return hidden, w, _batch(targets, seg)


def _loss_and_grad(config):
  def f(hidden, w, batch):
    sums = loss_lib.loss_sums(LinearHead(hidden, w, tiles=config.num_vocab_tiling), batch, config)
    return (sums.xent + sums.z_loss) / sums.weights

  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def test_vocab_tiling_equals_plain_loss_and_cuts_peak_memory(head):
  hidden, w, batch = head
  plain, tiled = tiny_config(num_devices=1, z_loss_multiplier=1e-3), tiny_config(num_devices=1, z_loss_multiplier=1e-3, num_vocab_tiling=8)
  (l1, g1), (l8, g8) = _loss_and_grad(plain)(hidden, w, batch), _loss_and_grad(tiled)(hidden, w, batch)
  np.testing.assert_allclose(float(l1), float(l8), rtol=1e-5)
  for a, b in zip(g1, g8):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)

  def temp_bytes(config):
    return _loss_and_grad(config).lower(hidden, w, batch).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = hidden.shape[0] * hidden.shape[1] * w.shape[1] * 4
  plain_bytes, tiled_bytes = temp_bytes(plain), temp_bytes(tiled)
  assert plain_bytes >= logits_bytes  # the full [B, S, V] logits exist without tiling
  assert tiled_bytes < plain_bytes / 3, (plain_bytes, tiled_bytes)


def test_vocab_tiling_needs_a_divisor_of_the_vocabulary(head):
  hidden, w, batch = head
  with pytest.raises(ConfigError, match="vocab_size 4096 is not divisible by num_vocab_tiling 3"):
    loss_lib.loss_sums(LinearHead(hidden, w, tiles=3), batch, tiny_config(num_devices=1, num_vocab_tiling=3))


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scale,soft_cap,tiles", [(1.0, 0.0, 1), (0.5, 3.0, 1), (1.0, 0.0, 4), (0.5, 3.0, 8)])
def test_fused_loss_gradient_equals_autodiff_of_the_logits(head, compute_dtype, scale, soft_cap, tiles):
  """OutputHead.loss_sums' hand-written backward pass (whole or streamed over vocabulary slices) against jax.grad of
  the same maths on OutputHead.logits."""
  hidden, w, batch = head
  hidden = hidden.astype(compute_dtype)
  targets, mask = batch["targets"], (batch["targets_segmentation"] != 0).astype(jnp.float32)
  out = OutputHead(w, compute_dtype, scale=scale, soft_cap=soft_cap, vocab_tiles=tiles)

  def fused(h, k):
    xent, z = dataclasses.replace(out, kernel=k).loss_sums(h, targets, mask, 1e-2)
    return 0.7 * xent + 1.3 * z

  def reference(h, k):
    logits = dataclasses.replace(out, kernel=k).logits(h)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return 0.7 * jnp.sum((lse - target) * mask) + 1.3 * jnp.sum(1e-2 * lse**2 * mask)

  (l_f, g_f), (l_r, g_r) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, w) for f in (fused, reference))
  np.testing.assert_allclose(float(l_f), float(l_r), rtol=1e-6)
  tol = 1e-5 if compute_dtype == jnp.float32 else 2e-2  # bf16: the reference rounds its logit gradient at other points
  for a, b in zip(g_f, g_r):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol * float(jnp.max(jnp.abs(b.astype(jnp.float32)))))


def test_bfloat16_logits_are_rounded_once_and_stay_within_bfloat16_of_float32_ones(head):
  """logits_dot_in_fp32=false (MaxText's default): the head's logits are the float32 product rounded to bfloat16 once
  (the fused loss keeps that bfloat16 array, half the float32 one); loss and gradients stay within bfloat16 rounding
  of logits_dot_in_fp32=true (float32 operands and logits)."""
  hidden, w, batch = head
  hidden = hidden.astype(jnp.bfloat16)
  targets, mask = batch["targets"], (batch["targets_segmentation"] != 0).astype(jnp.float32)
  bf16, fp32 = (OutputHead(w, jnp.bfloat16, soft_cap=3.0, dot_in_fp32=f) for f in (False, True))
  exact = jnp.einsum("...e,ev->...v", hidden.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32), precision="highest")
  logits = dataclasses.replace(bf16, soft_cap=0.0).logits(hidden)
  assert logits.dtype == jnp.float32 and bool(jnp.all(logits == logits.astype(jnp.bfloat16).astype(jnp.float32)))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(exact), rtol=2**-8, atol=1e-6)  # rounded once: half a bfloat16 ulp

  def loss(out):
    return jax.jit(jax.value_and_grad(lambda h, k: dataclasses.replace(out, kernel=k).loss_sums(h, targets, mask, 0.0)[0], argnums=(0, 1)))(hidden, w)

  (l_b, g_b), (l_f, g_f) = loss(bf16), loss(fp32)
  np.testing.assert_allclose(float(l_b), float(l_f), rtol=2e-3)
  for a, b in zip(g_b, g_f):
    b = np.asarray(b, np.float32)
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2e-2, atol=2e-2 * float(np.max(np.abs(b))))
