"""Time of MoE routing, dispatch and combine in one train step, measured apart from the step.

The same functions the MoE layer runs (maxtext.layers.moe.route, then maxtext.layers.moe_dispatch's sort_pairs,
expert_exchange.take_pairs and combine_sorted for the sorted paths, or expert_slots, pack and unpack_combine for the dense path
with per-expert buffers) are compiled with identity experts, forward and backward, on one device's tokens of one
micro-batch, timed, and multiplied by the MoE layers (plus MTP modules) and micro-batches per step. With remat the
step recomputes the forward once more, so the share is a lower bound.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from maxtext import platform
from maxtext.config import MaxTextConfig
from maxtext.layers import expert_exchange, moe, moe_dispatch
from maxtext.layers.dtypes import dtype
from maxtext.models import feed_forward_specs


def routing_dispatch_seconds(config: MaxTextConfig, repeats: int = 10) -> float:
  """Seconds per train step spent routing, dispatching and combining tokens (see the module docstring)."""
  c = config
  tokens = c.micro_batch_size_to_train_on // c.num_devices * c.max_target_length
  kx, kg = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (tokens, c.emb_dim), dtype(c.dtype))
  gate = jax.random.normal(kg, (c.emb_dim, c.num_experts), jnp.float32) * c.emb_dim**-0.5
  bias = jnp.zeros((c.num_experts,), jnp.float32) if c.routed_bias else None

  sparse = platform.moe_dispatch(c, platform.local_platform()) != "dense"
  seq = c.max_target_length
  spec = feed_forward_specs.moe(c)
  capacity = moe.expert_capacity(seq, spec) if c.capacity_factor > 0 else 0

  def one_layer(x: jax.Array, gate: jax.Array) -> jax.Array:
    r = moe.route(x.astype(jnp.float32) @ gate, spec.routing, bias)
    positions = moe.capacity_positions(r.experts.reshape(-1, seq, c.num_experts_per_tok), c.num_experts).reshape(r.experts.shape)
    kept = positions < capacity if capacity else None
    if sparse:
      pairs = moe_dispatch.sort_pairs(r.experts, kept, c.num_experts)
      rows = expert_exchange.take_pairs(x, pairs.order, pairs.inverse, c.num_experts_per_tok)
      y = moe_dispatch.combine_sorted(rows, pairs, r.weights, kept)
    else:
      slot, slots = moe_dispatch.expert_slots(r.experts, positions, seq, capacity, c.num_experts)
      y = moe_dispatch.unpack_combine(moe_dispatch.pack(x, slot, slots, c.num_experts), slot, r.weights)
    return jnp.sum(y)

  fn = jax.jit(jax.grad(one_layer, argnums=(0, 1)))
  jax.block_until_ready(fn(x, gate))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(x, gate))
    times.append(time.perf_counter() - start)
  layers = c.num_decoder_layers - c.first_num_dense_layers + c.mtp_num_layers
  return statistics.median(times) * layers * c.gradient_accumulation_steps
