"""Orbax checkpoints of the train state, and the restore order of a run.

Layout under config.checkpoint_dir (one directory per saved step, named by steps completed; the directory
itself is created by the first save):

    <step>/items/                            the full train state (Orbax PyTree, sharded arrays)
    <step>/schedule/                         the schedule record: learning_rate_schedule_steps this state was trained with
    <step>.unusable-<time>/                  a step that failed to restore, set aside (never deleted)
    data_iterator/<step>/process_<i>.json    each process's data-iterator state for that step (written before the step)

A step is usable only with all of its parts: arrays that match and restore, its schedule record, and (when the
run resumes its data) a data-iterator state the pipeline accepts. A step missing any part is set aside like a step
with damaged arrays, and the previous step is tried; a data position is never silently reset.

Restore order: the run's own latest checkpoint (full state + data position) -> else
load_parameters_path (params only; fresh optimizer, step 0) or load_full_state_path
(full state, fresh data) -> else a fresh init. Restores go straight into sharded arrays.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from maxtext.config import MaxTextConfig
from maxtext.distributed import all_processes_agree
from maxtext.errors import ConfigError, UserError
from maxtext.models import pipeline
from maxtext.train import outputs

ITEM = "items"
SCHEDULE = "schedule"  # Orbax JSON item of each step: {"learning_rate_schedule_steps": N}
SCHEDULE_KEY = "learning_rate_schedule_steps"
LEGACY_SCHEDULE_FILE = "schedule.json"  # one record for all steps, written by versions before the per-step record
DATA_DIR = "data_iterator"


@dataclasses.dataclass
class Restored:
  state: Any  # the train state, in the abstract state's shardings
  schedule_steps: int | None  # learning_rate_schedule_steps the state was trained with (None: not read)


def item_path(path: str) -> epath.Path:
  """Accept a step directory (<ckpt>/<step>), its item directory (<ckpt>/<step>/items), or a run's checkpoint
  directory (<run>/checkpoints: its newest saved step)."""
  p = epath.Path(path)
  newest = latest_saved_step(str(p)) if p.is_dir() and not (p / ITEM).is_dir() else None
  if newest is not None:
    p = epath.Path(newest)
  if (p / ITEM).is_dir():
    p = p / ITEM
  if not p.is_dir():
    raise ConfigError(f"checkpoint path '{path}' does not exist; pass a checkpoint step directory such as <run>/checkpoints/<step>/items")
  return p


class Checkpointer:
  """The run's CheckpointManager plus per-process data-iterator state. Creates nothing until the first save."""

  def __init__(self, config: MaxTextConfig):
    self.config = config
    self.directory = epath.Path(config.checkpoint_dir)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=config.max_num_checkpoints_to_keep,
      enable_async_checkpointing=config.async_checkpointing,
      create=False,  # save() creates the directory: a run that fails before its first save leaves none
      cleanup_tmp_directories=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, item_names=(ITEM, SCHEDULE), options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _data_file(self, step: int, process: int | None = None) -> epath.Path:
    return self.directory / DATA_DIR / str(step) / f"process_{jax.process_index() if process is None else process}.json"

  def save(self, step: int, state: Any, data_state: dict[str, Any] | None) -> None:
    """Save the state after `step` optimizer steps with its schedule record (async when async_checkpointing), its
    layers in plain order; the data-iterator state is written first, so a finished step always has one."""
    self.directory.mkdir(parents=True, exist_ok=True)
    if data_state is not None:
      f = self._data_file(step)
      f.parent.mkdir(parents=True, exist_ok=True)
      f.write_text(json.dumps(data_state))
    state = pipeline.to_storage(state, self.config)
    record = {SCHEDULE_KEY: self.config.learning_rate_schedule_steps}
    self.manager.save(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardSave(state), SCHEDULE: ocp.args.JsonSave(record)}), force=True)
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

  def restore_latest(self, abstract_state: Any, log: Callable[[str], None] = print, data_iter: Any = None) -> Restored | None:
    """The newest usable checkpoint, or None if there is none. With data_iter (an iterator with get_state/set_state)
    the step's schedule record and data-iterator state are part of the step, and data_iter is moved to that state.

    A step that fails to restore (no readable metadata, missing or truncated array data, a state whose step
    disagrees with its directory, a missing or damaged schedule record or data-iterator state) is moved aside (never
    deleted) with one log line, and the previous step is tried. Checkpoints of another model (shapes or parameters
    differ) are a ConfigError: nothing is moved.
    """
    initial = data_iter.get_state() if data_iter is not None else None
    abstract_state = pipeline.to_storage(abstract_state, self.config)  # the layout on disk
    for step in sorted(self.manager.all_steps(), reverse=True):
      problem = check_compatible(self.directory / str(step) / ITEM, abstract_state, self.config.checkpoint_dir)
      schedule = data_state = restored = None
      if problem is None and data_iter is not None:
        schedule, problem = self._schedule_record(step)
      if problem is None and data_iter is not None:
        data_state, problem = self._data_state(step)
      if problem is None:
        restored, problem = self._arrays(step, abstract_state)
      if problem is None and data_iter is not None:
        problem = _moved_to(data_iter, data_state, self.directory / str(step))
      if not all_processes_agree(problem is None) and problem is None:
        problem = "another process cannot use it"
      if problem is None:
        return Restored(pipeline.from_storage(restored, self.config), schedule)
      if data_iter is not None:
        data_iter.set_state(initial)
      self._set_aside(step, problem, log)
    return None

  def _arrays(self, step: int, abstract_state: Any) -> tuple[Any, str | None]:
    """(the step's train state, None) or (None, why its arrays are unusable)."""
    problem = None
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardRestore(abstract_state)}))[ITEM]
      if int(restored["step"]) != step:
        problem = f"its state is at step {int(restored['step'])}"
    except Exception as e:  # noqa: BLE001 - any failure to read this step's arrays means the step is damaged
      problem = f"its arrays do not restore: {_first_line(e).split(' See full')[0]}"
    if problem is not None:
      restored = None
      gc.collect()  # finalize the reads Orbax abandoned (the error held them) now (maxtext.errors.ABANDONED_READ_NOISE)
    return restored, problem

  def _schedule_record(self, step: int) -> tuple[int | None, str | None]:
    """(learning_rate_schedule_steps the step was trained with, None) or (None, why the record is unusable)."""
    if not (self.directory / str(step) / SCHEDULE).is_dir():
      legacy = self.directory / LEGACY_SCHEDULE_FILE
      if legacy.exists():
        value = _record_value(legacy.read_text())
        if value is None:
          raise ConfigError(
            f"the schedule record {legacy} is damaged; delete it to resume without it (the learning-rate schedule then follows "
            "learning_rate_schedule_steps of this config)"
          )
        return value, None
      return None, f"its schedule record {self.directory / str(step) / SCHEDULE} is missing"
    try:
      record = self.manager.restore(step, args=ocp.args.Composite(**{SCHEDULE: ocp.args.JsonRestore()}))[SCHEDULE]
    except Exception as e:  # noqa: BLE001 - an unreadable record makes the step unusable
      return None, f"its schedule record does not read: {_first_line(e)}"
    value = _record_value(json.dumps(record))
    return (value, None) if value is not None else (None, f"its schedule record is damaged: {json.dumps(record)[:100]}")

  def _data_state(self, step: int) -> tuple[dict[str, Any] | None, str | None]:
    """(this process's data-iterator state of the step, None) or (None, why it is unusable)."""
    f = self._data_file(step)
    if not f.exists():  # saved by fewer processes: process 0's state (global for synthetic data; grain refuses a different count)
      f = self._data_file(step, 0)
    if not f.exists():
      return None, f"its data-iterator state {self._data_file(step)} is missing"
    try:
      state = json.loads(f.read_text())
    except (ValueError, OSError) as e:
      return None, f"its data-iterator state {f} is damaged ({_first_line(e)})"
    if not isinstance(state, dict):
      return None, f"its data-iterator state {f} is damaged (not a JSON object)"
    return state, None

  def _set_aside(self, step: int, problem: str, log: Callable[[str], None]) -> None:
    """Move an unusable step directory to <step>.unusable-<time> (a name Orbax does not list) and forget it."""
    src = self.directory / str(step)
    dst = self.directory / f"{step}.unusable-{time.strftime('%Y%m%dT%H%M%S')}"
    if jax.process_index() == 0:
      src.rename(dst)
      log(f"checkpoint {src} is unusable ({problem}); moved it to {dst} and trying the previous step")
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f"maxtext_set_aside_{step}")
    self.manager.reload()

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _record_value(text: str) -> int | None:
  """learning_rate_schedule_steps of a schedule record's JSON text; None when it is not a valid record."""
  try:
    record = json.loads(text)
  except ValueError:
    return None
  value = record.get(SCHEDULE_KEY) if isinstance(record, dict) else None
  return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _moved_to(data_iter: Any, state: dict[str, Any], step_dir: epath.Path) -> str | None:
  """Move data_iter to a step's saved state: None, or why the state is damaged (ValueError and the like). A state of
  another pipeline (the iterator's UserError: other data settings or process count) is a one-line ConfigError."""
  try:
    data_iter.set_state(state)
  except UserError as e:
    raise ConfigError(
      f"checkpoint {step_dir}: {e}; or, to continue without its data position, start a new run from its state "
      f"(run_name=<new name> load_full_state_path={step_dir / ITEM}; the data then starts from its beginning)"
    ) from None
  except Exception as e:  # noqa: BLE001 - a state the iterator did not write is a damaged state
    return f"its data-iterator state is damaged ({type(e).__name__}: {_first_line(e)})"
  return None


def schedule_warning(config: MaxTextConfig, recorded: int | None, step: int, directory: Any) -> str | None:
  """The warning a resume at `step` prints when the learning-rate schedule now spans other steps than it was trained with."""
  steps = config.learning_rate_schedule_steps
  if recorded is None or recorded == steps:
    return None
  return (
    f"warning: the learning-rate schedule now spans {steps} steps, but the checkpoint at step {step} in {directory} was trained with "
    f"{recorded}; from step {step} on the learning rate follows the new schedule (pass learning_rate_schedule_steps={recorded} to keep the original)"
  )


def restore_params(path: str, abstract_params: Any) -> Any:
  """Only the 'params' subtree of a checkpoint, into the shardings abstract_params carries."""
  target = {"params": abstract_params}
  args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      return ckptr.restore(item_path(path), args=args)["params"]
  except Exception as e:  # noqa: BLE001 - a user-named checkpoint that does not read (wrong tree, truncated arrays) is a config error
    raise ConfigError(f"load_parameters_path '{path}' does not hold this model's parameters ({_first_line(e)}); check model_name and dimensions") from None


def restore_full_state(path: str, abstract_state: Any) -> Any:
  """A whole train state (params, optimizer state, step), into the shardings abstract_state carries."""
  try:
    with ocp.StandardCheckpointer() as ckptr:
      return ckptr.restore(item_path(path), abstract_state)
  except Exception as e:  # noqa: BLE001 - a user-named checkpoint that does not read (wrong tree, truncated arrays) is a config error
    raise ConfigError(
      f"load_full_state_path '{path}' does not match this run's train state ({_first_line(e)}); check the model and optimizer settings"
    ) from None


def save_params(path: str, params: Any) -> None:
  """Write a params-only checkpoint that load_parameters_path accepts (e.g. from a converter)."""
  outputs.check_can_make(path, "the checkpoint")  # Orbax's writer waits forever for a directory it failed to make
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(epath.Path(path), {"params": params})
    ckptr.wait_until_finished()


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else type(e).__name__


def param_shapes(path: str) -> dict[str, tuple[int, ...]]:
  """'/'-joined path -> shape of every parameter under 'params' in a checkpoint (from its metadata; no arrays read)."""
  item = item_path(path)
  tree = read_metadata_tree(item)
  if not isinstance(tree, dict) or not isinstance(tree.get("params"), dict):
    raise ConfigError(f"'{path}' is not a readable checkpoint (no 'params' in it); pass a checkpoint step directory such as <run>/checkpoints/<step>")
  return shapes_by_name(tree["params"])


def read_metadata_tree(item: epath.Path) -> Any:
  """The tree of array metadata in an Orbax PyTree item directory; ConfigError when it has none."""
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      metadata = ckptr.metadata(item)
  except Exception as e:  # noqa: BLE001 - Orbax raises many types for a directory that is not a checkpoint
    raise ConfigError(f"'{item}' is not a readable checkpoint ({_first_line(e)}); pass a checkpoint step directory such as <run>/checkpoints/<step>") from None
  tree = getattr(getattr(metadata, "item_metadata", None), "tree", None)
  if tree is None:
    raise ConfigError(
      f"'{item}' is not a readable checkpoint (no Orbax array metadata in it); pass a checkpoint step directory such as <run>/checkpoints/<step>"
    )
  return tree


def shapes_by_name(tree: Any) -> dict[str, tuple[int, ...]]:
  """'/'-joined path -> shape of every array in a state or metadata tree (a trailing Variable 'value' dropped)."""
  shapes = {}
  for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys]
    shapes["/".join(names[:-1] if names and names[-1] == "value" else names)] = tuple(getattr(leaf, "shape", ()))
  return shapes


def check_compatible(item: epath.Path, abstract_state: Any, checkpoint_dir: str) -> str | None:
  """None if the checkpoint item's metadata matches abstract_state; else why the step is damaged.

  Metadata that reads but describes another model is the user's change, not damage: a ConfigError.
  """
  try:
    tree = read_metadata_tree(item)
  except ConfigError as e:
    return f"no readable metadata: {str(e).split('(', 1)[-1].rsplit(')', 1)[0]}"
  saved, wanted = shapes_by_name(tree), shapes_by_name(abstract_state)
  for name, shape in sorted(wanted.items(), key=lambda kv: (not kv[0].startswith("params/"), kv[0])):  # parameters first: the clearest message
    if name not in saved:
      if not saved:
        return "its metadata lists no arrays"
      raise ConfigError(
        f"checkpoints in {checkpoint_dir} were written by another model or optimizer (they lack '{name}'); use a new run_name or the config they were written with"
      )
    if saved[name] != shape:
      raise ConfigError(
        f"checkpoints in {checkpoint_dir} hold '{name}' with shape {saved[name]}, this config needs {shape}; use a new run_name or the config they were written with"
      )
  return None


def restore_some_params(path: str, abstract_params: Any, what: str, may_lack: Any = None) -> tuple[Any, list[str]]:
  """The parameters of abstract_params (an nnx.State of sharded ShapeDtypeStructs) that the checkpoint holds.

  Returns (restored nnx.State, '/'-paths the checkpoint lacks). Lacking a parameter is a one-line ConfigError
  unless the nnx filter `may_lack` selects it (LoRA adapters and mHC connectors a base checkpoint cannot have);
  so is a parameter of another shape. `what` names the config key in messages.
  """
  present, lacking = match_params(path, abstract_params, what, may_lack)
  if present is None:
    from flax import nnx

    return nnx.State({}), lacking
  return restore_params(path, present), lacking


def match_params(path: str, abstract_params: Any, what: str, may_lack: Any = None) -> tuple[Any, list[str]]:
  """(the abstract params the checkpoint holds, as an nnx.State or None, '/'-paths it lacks); reads metadata only.

  Raises the one-line ConfigErrors restore_some_params documents.
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
  return (nnx.from_flat_state(present) if present else None), lacking


def newest_step_dir(checkpoint_dir: str) -> epath.Path | None:
  """The highest-numbered step directory under checkpoint_dir (finished or not), or None; creates nothing."""
  root = epath.Path(checkpoint_dir)
  if not root.is_dir():
    return None
  steps = [int(d.name) for d in root.iterdir() if d.name.isdigit() and d.is_dir()]
  return root / str(max(steps)) if steps else None


def saved_steps(checkpoint_dir: str) -> list[int]:
  """The steps under checkpoint_dir holding a saved train state (an <step>/items/ directory), ascending; creates nothing."""
  root = epath.Path(checkpoint_dir) if checkpoint_dir else None
  if root is None or not root.is_dir():
    return []
  return sorted(int(d.name) for d in root.iterdir() if d.name.isdigit() and (d / ITEM).is_dir())


def latest_saved_step(checkpoint_dir: str) -> str | None:
  """The newest <checkpoint_dir>/<step> holding a saved train state (its items/ directory), or None; creates nothing."""
  steps = saved_steps(checkpoint_dir)
  return str(epath.Path(checkpoint_dir) / str(steps[-1])) if steps else None


def overlay_params(params: Any, restored: Any) -> Any:
  """params with every parameter that `restored` holds replaced by its restored value."""
  from flax import nnx

  flat = dict(nnx.to_flat_state(params))
  flat.update(dict(nnx.to_flat_state(restored)))
  return nnx.from_flat_state(flat)
