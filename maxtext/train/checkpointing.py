"""Orbax checkpoints of the train state, and the restore order of a run.

Layout under config.checkpoint_dir (one directory per saved step, named by steps completed):

    <step>/items/                            the full train state (Orbax PyTree, sharded arrays)
    data_iterator/<step>/process_<i>.json    each process's data-iterator state for that step

Restore order: the run's own latest checkpoint (full state + data position) -> else
load_parameters_path (params only; fresh optimizer, step 0) or load_full_state_path
(full state, fresh data) -> else a fresh init. Restores go straight into sharded arrays.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError

ITEM = "items"
DATA_DIR = "data_iterator"


def _item_path(path: str) -> epath.Path:
  """Accept either a step directory (<ckpt>/<step>) or its item directory (<ckpt>/<step>/items)."""
  p = epath.Path(path)
  if (p / ITEM).is_dir():
    p = p / ITEM
  if not p.is_dir():
    raise ConfigError(f"checkpoint path '{path}' does not exist; pass a checkpoint step directory such as <run>/checkpoints/<step>/items")
  return p


class Checkpointer:
  """The run's CheckpointManager plus per-process data-iterator state."""

  def __init__(self, config: MaxTextConfig):
    self.config = config
    self.directory = epath.Path(config.checkpoint_dir)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=config.max_num_checkpoints_to_keep,
      enable_async_checkpointing=config.async_checkpointing,
      create=True,
      cleanup_tmp_directories=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, item_names=(ITEM,), options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _data_file(self, step: int, process: int | None = None) -> epath.Path:
    return self.directory / DATA_DIR / str(step) / f"process_{jax.process_index() if process is None else process}.json"

  def save(self, step: int, state: Any, data_state: dict[str, Any] | None) -> None:
    """Save the state after `step` optimizer steps (async when async_checkpointing)."""
    if data_state is not None:
      f = self._data_file(step)
      f.parent.mkdir(parents=True, exist_ok=True)
      f.write_text(json.dumps(data_state))
    self.manager.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardSave(state)}), force=True)
    self._prune_data_states(keep={step, *self.manager.all_steps()})

  def _prune_data_states(self, keep: set[int]) -> None:
    root = self.directory / DATA_DIR
    if not root.is_dir():
      return
    for d in root.iterdir():
      if d.name.isdigit() and int(d.name) not in keep:
        own = d / f"process_{jax.process_index()}.json"
        if own.exists():
          own.unlink()

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict[str, Any] | None] | None:
    """(state, data-iterator state) of the latest checkpoint, or None if there is none."""
    step = self.latest_step()
    if step is None:
      return None
    restored = self.manager.restore(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardRestore(abstract_state)}))
    f = self._data_file(step)
    if not f.exists():  # saved by fewer processes: process 0's state (global for synthetic data; grain refuses a different count)
      f = self._data_file(step, 0)
    return restored[ITEM], (json.loads(f.read_text()) if f.exists() else None)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def restore_params(path: str, abstract_params: Any) -> Any:
  """Only the 'params' subtree of a checkpoint, into the shardings abstract_params carries."""
  target = {"params": abstract_params}
  args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      return ckptr.restore(_item_path(path), args=args)["params"]
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"load_parameters_path '{path}' does not hold this model's parameters ({_first_line(e)}); check model_name and dimensions") from None


def restore_full_state(path: str, abstract_state: Any) -> Any:
  """A whole train state (params, optimizer state, step), into the shardings abstract_state carries."""
  try:
    with ocp.StandardCheckpointer() as ckptr:
      return ckptr.restore(_item_path(path), abstract_state)
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError(
      f"load_full_state_path '{path}' does not match this run's train state ({_first_line(e)}); check the model and optimizer settings"
    ) from None


def save_params(path: str, params: Any) -> None:
  """Write a params-only checkpoint that load_parameters_path accepts (e.g. from a converter)."""
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(epath.Path(path), {"params": params})
    ckptr.wait_until_finished()


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else type(e).__name__


def param_shapes(path: str) -> dict[str, tuple[int, ...]]:
  """'/'-joined path -> shape of every parameter under 'params' in a checkpoint (from its metadata; no arrays read)."""
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      tree = ckptr.metadata(_item_path(path)).item_metadata.tree
  except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
    raise ConfigError(f"'{path}' is not a readable checkpoint ({_first_line(e)}); pass a checkpoint step directory such as <run>/checkpoints/<step>") from None
  shapes = {}
  for keys, meta in jax.tree_util.tree_flatten_with_path(tree.get("params", {}) if isinstance(tree, dict) else {})[0]:
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in keys]
    shapes["/".join(names[:-1] if names and names[-1] == "value" else names)] = tuple(getattr(meta, "shape", ()))
  return shapes


def restore_some_params(path: str, abstract_params: Any, what: str, may_lack: Any = None) -> tuple[Any, list[str]]:
  """The parameters of abstract_params (an nnx.State of sharded ShapeDtypeStructs) that the checkpoint holds.

  Returns (restored nnx.State, '/'-paths the checkpoint lacks). Lacking a parameter is a one-line ConfigError
  unless the nnx filter `may_lack` selects it (LoRA adapters and mHC connectors a base checkpoint cannot have);
  so is a parameter of another shape. `what` names the config key in messages.
  """
  from flax import nnx

  shapes = param_shapes(path)
  may_lack_pred = nnx.filterlib.to_predicate(may_lack if may_lack is not None else nnx.Nothing)
  present, lacking = [], []
  for keys, var in nnx.to_flat_state(abstract_params):
    name = "/".join(str(k) for k in keys)
    shape = tuple(var.get_value().shape)
    if name not in shapes:
      if not may_lack_pred(keys, var):
        raise ConfigError(f"{what} '{path}' has no parameter '{name}' that this model needs; check the model config (and lora settings) it was written with")
      lacking.append(name)
    elif shapes[name] != shape:
      raise ConfigError(f"{what} '{path}' holds '{name}' with shape {shapes[name]}, this model needs {shape}; use the config it was written with")
    else:
      present.append((keys, var))
  if not present:
    return nnx.State({}), lacking
  return restore_params(path, nnx.from_flat_state(present)), lacking


def overlay_params(params: Any, restored: Any) -> Any:
  """params with every parameter that `restored` holds replaced by its restored value."""
  from flax import nnx

  flat = dict(nnx.to_flat_state(params))
  flat.update(dict(nnx.to_flat_state(restored)))
  return nnx.from_flat_state(flat)


def load_initial_params(config: MaxTextConfig, params: Any, abstract_params: Any, log: Any, adapters: bool = True) -> Any:
  """Freshly initialised params overlaid with load_parameters_path, then (adapters=True) lora.lora_restore_path.

  A base checkpoint may lack LoRA adapters and mHC connectors: they keep their init (identity at step 0).
  lora.lora_restore_path restores the adapters (and connectors it holds) of an earlier LoRA run or of
  `python -m maxtext.convert peft-to-lora`.
  """
  from flax import nnx

  from maxtext.layers.lora import LoRAParam
  from maxtext.layers.mhc import MHCParam

  if config.load_parameters_path:
    restored, lacking = restore_some_params(config.load_parameters_path, abstract_params, "load_parameters_path", may_lack=nnx.Any(LoRAParam, MHCParam))
    params = overlay_params(params, restored)
    note = f" ({len(lacking)} adapter/connector arrays it lacks keep their init)" if lacking else ""
    log(f"loaded parameters from {config.load_parameters_path}{note}")
  if adapters and config.lora.lora_restore_path:
    if not config.lora.enable_lora:
      raise ConfigError(f"lora.lora_restore_path='{config.lora.lora_restore_path}' needs lora.enable_lora=true")
    wanted = nnx.filter_state(abstract_params, nnx.Any(LoRAParam, MHCParam))
    restored, _ = restore_some_params(config.lora.lora_restore_path, wanted, "lora.lora_restore_path", may_lack=MHCParam)
    params = overlay_params(params, restored)
    log(f"loaded LoRA adapters from {config.lora.lora_restore_path}")
  return params
