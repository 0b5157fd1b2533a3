"""remat_policy name -> the jax.checkpoint policy of each decoder layer."""

from __future__ import annotations

from collections.abc import Callable

import jax

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


def policy(name: str):
  """The checkpoint policy for a remat_policy name ('full' saves nothing; 'none' is handled by the caller)."""
  if name == "auto":
    raise ValueError("remat_policy=auto is resolved before the model is built (maxtext.aot.remat_auto.resolve)")
  if name == "full":
    return None
  if name in SAVED_NAMES:
    return jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES[name])
  if name in OFFLOADED:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=list(SAVED_NAMES[OFFLOADED[name]]),
      offload_src="device",
      offload_dst="pinned_host",
    )
  raise ValueError(f"unknown remat_policy {name}")


def wrap(fn: Callable, name: str, prevent_cse: bool) -> Callable:
  """fn rematerialised under the named policy ('none' returns fn unchanged)."""
  if name == "none":
    return fn
  return jax.checkpoint(fn, policy=policy(name), prevent_cse=prevent_cse)
