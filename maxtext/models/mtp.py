"""Multi-token prediction (DeepSeek V3): a chain of modules, module k predicting the token k + 1 ahead of the main model.

Module k takes the previous depth's hidden states h^{k-1} (h^0: the main model's last layer output, before its
final norm) and the embeddings of the tokens k positions ahead: h^k = layer(proj([norm(emb); norm(h^{k-1})])).
Its logits come from the shared output head after its own norm. Training-only: the mean over modules of their
cross entropy, times mtp_loss_scaling_factor, is added to the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.layers.linear import DenseGeneral, dense_kwargs
from maxtext.layers.norms import RMSNorm
from maxtext.layers.residual import collapse_streams, expand_streams
from maxtext.models import remat
from maxtext.models.decoder_layer import DecoderLayer, LayerSpec
from maxtext.platform import Policy


class MTPBlock(nnx.Module):
  """One module of the chain: its layer is built like the main model's layers (spec), rematerialised by remat_policy."""

  def __init__(self, spec: LayerSpec, remat_policy: str, *, policy: Policy, rngs: nnx.Rngs):
    e = spec.emb_dim
    self.residual = spec.residual
    self.remat_policy = remat_policy
    self.embed_norm = RMSNorm.of(e, spec.norm, policy.dtypes)
    self.hidden_norm = RMSNorm.of(e, spec.norm, policy.dtypes)
    self.projection = DenseGeneral((2 * e,), (e,), ("mlp", "embed"), **dense_kwargs(policy, rngs))
    self.layer = DecoderLayer(spec, policy=policy, rngs=rngs)
    self.out_norm = RMSNorm.of(e, spec.norm, policy.dtypes)

  def __call__(
    self, hidden: jax.Array, ahead_embeddings: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, window: int
  ) -> tuple[jax.Array, jax.Array]:
    """(h^{k-1} [B,S,E], embeddings of tokens k ahead [B,S,E]) -> (h^k, out_norm(h^k) for the output head)."""
    x = self.projection(jnp.concatenate([self.embed_norm(ahead_embeddings), self.hidden_norm(hidden)], axis=-1))
    graphdef, state = nnx.split(self.layer)

    def layer(x, state, positions, segment_ids):
      return nnx.merge(graphdef, state)(x, positions, segment_ids, window)[0]

    # rematerialised like the decoder's layers; all gradients at once, so none of this layer's waits past the layer loop
    x = remat.gradients_together(remat.wrap(layer, self.remat_policy, prevent_cse=True))(expand_streams(x, self.residual), state, positions, segment_ids)
    h = collapse_streams(x, self.residual)
    return h, self.out_norm(h)


def shift_left(x: jax.Array, k: int) -> jax.Array:
  """x[:, i] <- x[:, i + k] along the sequence axis, zeros past the end."""
  return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)


def mtp_xent_sum(model, pre_norm: jax.Array, batch: dict[str, jax.Array], scaling_factor: float, layout=None) -> jax.Array:
  """scaling_factor (mtp_loss_scaling_factor) x mean over modules of each module's summed cross entropy (over targets
  it can see); the modules' attention has the window of the model's last layer.

  batch in natural order; pre_norm (and the modules' attention) in the order of the context-parallel layout, which
  the shifted per-token arrays are put in too (None: natural order)."""
  order = (lambda x: x) if layout is None else layout.reorder
  tokens, targets = batch["inputs"], batch["targets"]
  positions, segments = order(batch["inputs_position"]), batch["inputs_segmentation"]
  head = model.output_head()
  window = model.specs.kinds[-1].window
  h, total = pre_norm, jnp.zeros((), jnp.float32)
  for k, block in enumerate(model.mtp, start=1):
    h, normed = block(h, model.embed_tokens(order(shift_left(tokens, k))), positions, order(segments), window)
    same_document = shift_left(segments, k) == segments
    mask = ((shift_left(batch["targets_segmentation"], k) != 0) & same_document).astype(jnp.float32)
    xent, _ = head.loss_sums(normed, order(shift_left(targets, k)), order(mask), 0.0)
    total = total + xent
  return total * (scaling_factor / len(model.mtp))
