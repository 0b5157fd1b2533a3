"""The reference model of DPO and GRPO: the policy as it was when post-training started, never trained.

- Full finetuning: the train state holds a frozen copy of the initial parameters under "reference" (so the
  compiled step's arguments, and with them the preflight memory check and train_compile, count it). Checkpoints
  leave it out; a resumed run rebuilds it from where the run started (load_full_state_path's parameters, else
  load_parameters_path over the seeded init, else the seeded init).
- LoRA: the base model with the adapters switched off (every adapter's A and B read as zero), so no second
  copy of the base exists. Only trainable parameters that are not adapters (the mHC connectors, when
  mhc_expansion_rate > 1) are kept as a frozen copy of their initial values.

`reference_trainable(config, state, trainable)` gives the reference's values of the trainable parameters; the
frozen ones are the policy's own. DPO computes the reference log-probabilities in the same step as the policy's
(one more forward pass, no gradient); GRPO computes them once per rollout batch, when it scores the rollouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext.config import MaxTextConfig
from maxtext.train.trainable import split_params

KEY = "reference"


def needed(config: MaxTextConfig) -> bool:
  """DPO always compares with the reference; GRPO only for its KL term (grpo_beta > 0)."""
  return config.use_dpo or (config.use_grpo and config.grpo_beta > 0)


def _adapter_filter() -> Any:
  from maxtext.layers.lora import LoRAParam

  return LoRAParam


def _stored_part(config: MaxTextConfig, trainable: nnx.State) -> nnx.State:
  """The trainable parameters the reference keeps a copy of: all of them, or with LoRA all but the adapters."""
  if not config.lora.enable_lora:
    return trainable
  return nnx.split_state(trainable, _adapter_filter(), ...)[1]


def stores_copy(config: MaxTextConfig, abstract_params: nnx.State) -> bool:
  """Whether the train state carries a 'reference' entry (a non-empty frozen copy)."""
  if not needed(config):
    return False
  return bool(jax.tree.leaves(_stored_part(config, split_params(abstract_params, config)[0])))


def initial(config: MaxTextConfig, params: nnx.State) -> nnx.State:
  """The frozen copy to store, taken from the initial full parameters (new buffers: the state donates them)."""
  return jax.tree.map(jnp.copy, _stored_part(config, split_params(params, config)[0]))


def reference_trainable(config: MaxTextConfig, state: dict[str, Any], trainable: nnx.State) -> nnx.State:
  """The reference's values of the trainable parameters: the stored copy, with LoRA adapters read as zero."""
  stored = state.get(KEY)
  if not config.lora.enable_lora:
    return stored
  adapters, _ = nnx.split_state(trainable, _adapter_filter(), ...)
  off = jax.tree.map(jnp.zeros_like, adapters)
  return off if stored is None or not jax.tree.leaves(stored) else nnx.merge_state(off, stored)


def attach_after_load(config: MaxTextConfig, state: dict[str, Any]) -> dict[str, Any]:
  """A fresh state whose parameters were just loaded (load_parameters_path, lora.lora_restore_path): the reference
  becomes a copy of them instead of the seeded init's."""
  if KEY in state and (config.load_parameters_path or config.lora.lora_restore_path):
    state = dict(state, **{KEY: initial(config, state["params"])})
  return state


def attach_on_restore(setup: Any, state: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
  """A restored checkpoint (which leaves the reference out): rebuild it from where the run started."""
  config = setup.config
  abstract_params = setup.abstract_state["params"]
  if KEY in state or not stores_copy(config, abstract_params):
    return state
  from maxtext.train import checkpoint_files, initial_params

  quiet = lambda message: None  # noqa: E731 - the loads were logged when the run started
  wanted = _stored_part(config, split_params(abstract_params, config)[0])
  if config.load_full_state_path:
    restored, _ = checkpoint_files.restore_some_params(config.load_full_state_path, wanted, "load_full_state_path")
    return dict(state, **{KEY: restored})
  params = initial_params.load_initial_params(config, setup.init_params(), abstract_params, quiet)
  log("rebuilt the reference model from the run's initial parameters")
  return dict(state, **{KEY: _stored_part(config, split_params(params, config)[0])})
