"""What the layer loops keep for the backward pass: remat_policy name -> the jax.checkpoint policy of each decoder layer,
and tied_to_carry, which keeps stacked weights' dtype casts inside the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
MLP_IN = ("mlpwi_0", "mlpwi_1", "mlpwi")

SAVED_NAMES: dict[str, tuple[str, ...]] = {
  "minimal": QKV + ("out_proj",) + MLP_IN + ("mlpwo",),
  "save_dot_except_mlpwi": QKV + ("out_proj", "mlpwo"),
  "save_dot_except_mlp": QKV + ("out_proj",),
  "save_qkv_proj": QKV,
  "save_out_proj": ("out_proj",),
}
OFFLOADED: dict[str, str] = {"minimal_offloaded": "minimal", "qkv_proj_offloaded": "save_qkv_proj"}


LAYER_INPUT = "decoder_layer_input"
SLICED_WEIGHTS = "pipeline_layer_weights"  # a layer's weights sliced from a pipeline stage's stack: recomputed, never saved


def policy(name: str, offload_input: bool = False):
  """The checkpoint policy for a remat_policy name ('full' saves nothing; 'none' is handled by the caller).

  offload_input: each layer's input (named LAYER_INPUT) goes to pinned host memory instead of staying on the device.
  """
  if name == "auto":
    raise ValueError("remat_policy=auto is resolved before the model is built (maxtext.aot.remat_auto.resolve)")
  if name not in ("full", *SAVED_NAMES, *OFFLOADED):
    raise ValueError(f"unknown remat_policy {name}")
  saved = () if name == "full" else SAVED_NAMES[OFFLOADED.get(name, name)]
  offloaded = list(saved) if name in OFFLOADED else []
  on_device = [] if name in OFFLOADED else list(saved)
  if offload_input:
    offloaded.append(LAYER_INPUT)
  if not offloaded:
    return jax.checkpoint_policies.save_only_these_names(*on_device) if on_device else None
  return jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=on_device,
    names_which_can_be_offloaded=offloaded,
    offload_src="device",
    offload_dst="pinned_host",
  )


def wrap(fn: Callable, name: str, prevent_cse: bool, offload_input: bool = False, sliced_weights: bool = False) -> Callable:
  """fn rematerialised under the named policy ('none' returns fn unchanged).

  With offload_input, fn must name its input with `checkpoint_name(h, LAYER_INPUT)` before any other use of it: the
  backward pass then recomputes from the host copy and the device keeps no copy of the input.
  sliced_weights: fn slices its layer's weights out of a larger stack and names them SLICED_WEIGHTS (pipeline stages);
  under 'none' everything else is saved, so the backward pass re-slices instead of keeping a copy per visit.
  """
  if name == "none":
    if sliced_weights:
      return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_anything_except_these_names(SLICED_WEIGHTS), prevent_cse=prevent_cse)
    return fn
  return jax.checkpoint(fn, policy=policy(name, offload_input), prevent_cse=prevent_cse)


def gradients_together(fn: Callable) -> Callable:
  """fn whose backward pass returns all its cotangents at once, through one optimization_barrier.

  XLA may postpone a weight gradient that only the optimizer update reads (an unscanned layer's, such as a
  multi-token-prediction layer's) past the rest of the backward pass, and that keeps the layer's residuals alive
  through the layer loop's backward (2.7 GB per device on an 8-layer proxy of deepseek3-671b on v5p-256;
  benchmarks/README.md).
  """

  def forward(*args):
    return jax.vjp(fn, *args)  # (output, the vjp function as the residual)

  def backward(vjp, cotangent):
    return jax.lax.optimization_barrier(vjp(cotangent))

  tied = jax.custom_vjp(fn)
  tied.defvjp(forward, backward)
  return tied


def sequential_backward(fn: Callable) -> Callable:
  """fn whose backward pass starts only when its output's cotangent exists and ends all at once: its saved residuals
  pass through one optimization_barrier together with the cotangent before anything reads them, and every cotangent
  it returns (the weights' gradients with the input's) leaves through a second one.

  Several rematerialised layers in one loop body (a scanned group of p layers of different structures) otherwise let
  XLA recompute a layer's forward before the layers above it have run their backward, and postpone each layer's
  weight-gradient matmuls (which only the loop's gradient accumulators read) to the end of the body, so all p
  layers' recomputed activations live at once (gemma4-31b on v5p-32: 16 to 18 [B, S, mlp] MLP activations, about
  3 GB per device, at the step's peak; docs/tpu.md). With both barriers the group's layers run their backward passes
  one after the other, each recomputed just before its own.
  """

  def forward(*args):
    return jax.vjp(fn, *args)

  def backward(vjp, cotangent):
    residuals, treedef = jax.tree.flatten(vjp)
    residuals, cotangent = jax.lax.optimization_barrier((residuals, cotangent))
    return jax.lax.optimization_barrier(jax.tree.unflatten(treedef, residuals)(cotangent))

  ordered = jax.custom_vjp(fn)
  ordered.defvjp(forward, backward)
  return ordered


def tied_to_carry(weights: Any, carry: jax.Array, compute_dtype: Any) -> Any:
  """weights stored in another dtype than compute_dtype, plus a zero that XLA cannot prove is zero (0 x the loop
  carry's first element, without gradient); weights already in the compute dtype are returned as they are.

  Values are unchanged, but each layer's compute-dtype weight casts now depend on the iteration, so XLA cannot hoist
  a cast copy of the whole stack out of the layer scan and keep it alive through the backward pass (for a large
  model, gigabytes per device: benchmarks/README.md, figures behind code comments). The add fuses into the cast.
  """
  zero = jax.lax.stop_gradient(carry.reshape(-1)[0]).astype(jnp.float32) * 0.0

  def tie(w: jax.Array) -> jax.Array:
    cast_later = jnp.issubdtype(w.dtype, jnp.floating) and w.dtype != compute_dtype
    return w + zero.astype(w.dtype) if cast_later else w

  return jax.tree.map(tie, weights)
