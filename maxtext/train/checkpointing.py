"""Orbax checkpoints of the train state, and the restore order of a run.

Layout under config.checkpoint_dir (one directory per saved step, named by steps completed; the directory
itself is created by the first save):

    <step>/items/                            the full train state (Orbax PyTree, sharded arrays)
    <step>/schedule/                         the schedule record: learning_rate_schedule_steps this state was trained with
    <step>/manifest/                         a checksum of each array, and the settings that shaped the state (MANIFEST)
    <step>.unusable-<time>/                  a step that failed to restore, set aside (never deleted)
    data_iterator/<step>/process_<i>.json    each process's data-iterator state for that step (written before the step)

A step is usable only with all of its parts: arrays that match, restore and agree with their checksums, its schedule
record, and (when the run resumes its data) a data-iterator state the pipeline accepts. A step missing any part is set
aside like a step with damaged arrays, and the previous step is tried; a data position is never silently reset. A
step that holds another train state than the config builds (another optimizer, model or LoRA setting) is not damaged:
that is a ConfigError naming the settings that changed, and nothing is moved. Nothing of a committed step is deleted
before a newer step is committed.

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
from maxtext.errors import ConfigError, UserError, shorten
from maxtext.models import pipeline, pipeline_specs
from maxtext.train import checksums
from maxtext.train.checkpoint_files import (
  ITEM,
  error_text,
  first_line,
  item_path,
  read_metadata_tree,
  shapes_by_name,
)

SCHEDULE = "schedule"  # Orbax JSON item of each step: {"learning_rate_schedule_steps": N}
SCHEDULE_KEY = "learning_rate_schedule_steps"
MANIFEST = "manifest"  # Orbax JSON item of each step: {"arrays": {path: [dtype, checksum]}, "settings": {key: value}, "layout": layout_of}
# The settings a manifest records: those that shape the checkpointed state (or, for LoRA, the frozen base it trained over).
MANIFEST_SETTINGS = (
  "opt_type",
  "sgd_momentum",
  "skip_step_on_spikes",
  "skip_step_interval",
  "lora.enable_lora",
  "lora.lora_rank",
  "lora.lora_module_path",
  "lora.max_lora_adapters",
  "load_parameters_path",
)
LEGACY_SCHEDULE_FILE = "schedule.json"  # one record for all steps, written by versions before the per-step record
DATA_DIR = "data_iterator"


@dataclasses.dataclass
class Restored:
  state: Any  # the train state, in the abstract state's shardings
  schedule_steps: int | None  # learning_rate_schedule_steps the state was trained with (None: not read)


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
    self.manager = ocp.CheckpointManager(self.directory, item_names=(ITEM, SCHEDULE, MANIFEST), options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _data_file(self, step: int, process: int | None = None) -> epath.Path:
    return self.directory / DATA_DIR / str(step) / f"process_{jax.process_index() if process is None else process}.json"

  def save(self, step: int, state: Any, data_state: dict[str, Any] | None) -> None:
    """Save the state after `step` optimizer steps with its schedule record and manifest (async when
    async_checkpointing), its layers in plain order; the data-iterator state is written first, so a finished step
    always has one."""
    self.directory.mkdir(parents=True, exist_ok=True)
    if data_state is not None:
      f = self._data_file(step)
      f.parent.mkdir(parents=True, exist_ok=True)
      f.write_text(json.dumps(data_state))
    state = pipeline.to_storage(state, pipeline_specs.pipeline(self.config))
    record = {SCHEDULE_KEY: self.config.learning_rate_schedule_steps}
    manifest = {"arrays": checksums.of_state(state), "settings": settings_of(self.config), "layout": layout_of(self.config)}
    items = {ITEM: ocp.args.StandardSave(state), SCHEDULE: ocp.args.JsonSave(record), MANIFEST: ocp.args.JsonSave(manifest)}
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._prune_data_states(keep=step)

  def _prune_data_states(self, keep: int | None = None) -> None:
    """Delete this process's data-iterator states of steps whose directory is gone (Orbax deleted them, after a newer
    step was committed), except `keep` (a step being saved). The state of a step that is still on disk, committed
    or not, stays: Orbax's step list drops an old step as soon as a newer save starts, before that save commits,
    so pruning by that list would leave the last committed step without its data position if the process died
    before the commit."""
    root = self.directory / DATA_DIR
    if not root.is_dir():
      return
    on_disk = {int(d.name.split(".", 1)[0]) for d in self.directory.iterdir() if d.name.split(".", 1)[0].isdigit()}
    for d in root.iterdir():
      if d.name.isdigit() and int(d.name) not in on_disk and int(d.name) != keep:
        own = d / f"process_{jax.process_index()}.json"
        if own.exists():
          own.unlink()

  def restore_latest(self, abstract_state: Any, log: Callable[[str], None] = print, data_iter: Any = None) -> Restored | None:
    """The newest usable checkpoint, or None if there is none. With data_iter (an iterator with get_state/set_state)
    the step's schedule record and data-iterator state are part of the step, and data_iter is moved to that state.

    A step that fails to restore (no readable metadata, missing, truncated or altered array data, a state whose step
    disagrees with its directory, a missing or damaged schedule record, manifest or data-iterator state) is moved
    aside (never deleted) with one log line, and the previous step is tried. Checkpoints of another train state
    (another model, optimizer or LoRA setting) are a ConfigError: nothing is moved.
    """
    initial = data_iter.get_state() if data_iter is not None else None
    abstract_state = pipeline.to_storage(abstract_state, pipeline_specs.pipeline(self.config))  # the layout on disk
    settings = settings_of(self.config)
    for step in sorted(self.manager.all_steps(), reverse=True):
      problem = check_compatible(self.directory / str(step) / ITEM, abstract_state, self.config.checkpoint_dir, settings)
      schedule = data_state = restored = manifest = None
      if problem is None:
        manifest, problem = read_manifest(self.directory / str(step))
      if problem is None and data_iter is not None:
        schedule, problem = self._schedule_record(step)
      if problem is None and data_iter is not None:
        data_state, problem = self._data_state(step)
      if problem is None:
        restored, problem = self._arrays(step, abstract_state, manifest)
      if problem is None and data_iter is not None:
        problem = moved_to(data_iter, data_state, self.directory / str(step))
      if not all_processes_agree(problem is None) and problem is None:
        problem = "another process cannot use it"
      if problem is None:
        return Restored(pipeline.from_storage(restored, pipeline_specs.pipeline(self.config)), schedule)
      if data_iter is not None:
        data_iter.set_state(initial)
      self._set_aside(step, problem, log)
    return None

  def _arrays(self, step: int, abstract_state: Any, manifest: dict[str, Any] | None) -> tuple[Any, str | None]:
    """(the step's train state, None) or (None, why its arrays are unusable): they do not read, hold another step,
    or differ from the checksums its manifest recorded when they were saved."""
    problem = None
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**{ITEM: ocp.args.StandardRestore(abstract_state)}))[ITEM]
      if int(restored["step"]) != step:
        problem = f"its state is at step {int(restored['step'])}"
      else:
        problem = checksum_problem(manifest, restored)
    except Exception as e:  # noqa: BLE001 - any failure to read this step's arrays means the step is damaged
      problem = f"its arrays do not restore: {first_line(e).split(' See full')[0]}"
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
      return None, f"its schedule record does not read: {first_line(e)}"
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
      return None, f"its data-iterator state {f} is damaged ({first_line(e)})"
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
    self._prune_data_states()

  def close(self) -> None:
    self.wait()
    self.manager.close()


def _record_value(text: str) -> int | None:
  """learning_rate_schedule_steps of a schedule record's JSON text; None when it is not a valid record."""
  try:
    record = json.loads(text)
  except ValueError:
    return None
  value = record.get(SCHEDULE_KEY) if isinstance(record, dict) else None
  return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def settings_of(config: MaxTextConfig) -> dict[str, Any]:
  """The MANIFEST_SETTINGS of config, by their dotted key names."""
  out = {}
  for key in MANIFEST_SETTINGS:
    value: Any = config
    for part in key.split("."):
      value = getattr(value, part)
    out[key] = value
  return out


def layout_of(config: MaxTextConfig) -> dict[str, int]:
  """What a manifest records of the device layout a step was trained on (for elastic_batch on a resume elsewhere)."""
  return {"num_devices": config.num_devices, "global_batch_size_to_train_on": config.global_batch_size_to_train_on}


def read_manifest(step_dir: epath.Path) -> tuple[dict[str, Any] | None, str | None]:
  """(a step's manifest, None); (None, None) for a step saved before manifests were written; (None, why it is unusable)."""
  item = step_dir / MANIFEST
  if not item.is_dir():
    return None, None
  try:
    manifest = json.loads((item / "metadata").read_text())  # how Orbax stores a JSON item
  except (ValueError, OSError) as e:
    return None, f"its manifest {item} does not read ({first_line(e)})"
  arrays = manifest.get("arrays") if isinstance(manifest, dict) else None
  settings = manifest.get("settings") if isinstance(manifest, dict) else None
  if not isinstance(arrays, dict) or not isinstance(settings, dict):
    return None, f"its manifest {item} is damaged (not a manifest)"
  return manifest, None


def check_lora_base(config: MaxTextConfig, step_dir: epath.Path, what: str) -> None:
  """A LoRA checkpoint holds only the adapters: resumed without the frozen base it trained over (its manifest's
  load_parameters_path), the adapters would train over a random init. That is a one-line ConfigError."""
  if not config.lora.enable_lora or config.load_parameters_path:
    return
  manifest, _ = read_manifest(step_dir)
  base = manifest["settings"].get("load_parameters_path") if manifest else None
  if base:
    raise ConfigError(
      f"{what} {step_dir} holds LoRA adapters trained over the frozen base load_parameters_path={base}, but this config sets no "
      f"load_parameters_path, so the base would be a random init; pass load_parameters_path={base}"
    )


def checksum_problem(manifest: dict[str, Any] | None, restored: Any) -> str | None:
  """None when the restored arrays agree with the checksums the manifest recorded (or there is no manifest); else why not."""
  if manifest is None:
    return None
  bad = checksums.mismatches(manifest["arrays"], restored)
  if not bad:
    return None
  return f"its arrays differ from the checksums recorded when it was saved: {shorten(bad, 3)}"


def moved_to(data_iter: Any, state: dict[str, Any], step_dir: epath.Path) -> str | None:
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
    return f"its data-iterator state is damaged ({type(e).__name__}: {first_line(e)})"
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


def restore_full_state(path: str, abstract_state: Any) -> Any:
  """A whole train state (params, optimizer state, step), into the shardings abstract_state carries; checked
  against the checksums its step's manifest recorded."""
  item = item_path(path)
  manifest, problem = read_manifest(item.parent)
  try:
    with ocp.StandardCheckpointer() as ckptr:
      state = ckptr.restore(item, abstract_state)
  except Exception as e:  # noqa: BLE001 - a user-named checkpoint that does not read (wrong tree, truncated arrays) is a config error
    gc.collect()
    raise ConfigError(
      f"load_full_state_path '{path}' does not match this run's train state ({error_text(e)}); check the model and optimizer settings"
    ) from None
  problem = problem or checksum_problem(manifest, state)
  if problem:
    raise ConfigError(f"load_full_state_path '{path}' is damaged ({problem}); pass an earlier step of that run")
  return state


def check_compatible(item: epath.Path, abstract_state: Any, checkpoint_dir: str, settings: dict[str, Any] | None = None) -> str | None:
  """None if the checkpoint item's metadata matches abstract_state; else why the step is damaged.

  Metadata that reads but describes another train state (arrays it lacks or holds beyond this config's state, or of
  other shapes) is the user's change, not damage: a ConfigError naming what changed (from the step's manifest and
  `settings`, this config's settings_of) and how to go on.
  """
  try:
    tree = read_metadata_tree(item)
  except ConfigError as e:
    return f"no readable metadata: {str(e).split('(', 1)[-1].rsplit(')', 1)[0]}"
  saved, wanted = shapes_by_name(tree), shapes_by_name(abstract_state)
  if not saved:
    return "its metadata lists no arrays"
  order = lambda names: sorted(names, key=lambda n: (not n.startswith("params/"), n))  # noqa: E731 - parameters first: the clearest message
  missing, extra = order(set(wanted) - set(saved)), order(set(saved) - set(wanted))
  if missing or extra:
    raise ConfigError(_another_state(item, checkpoint_dir, missing, extra, settings))
  for name in order(wanted):
    if saved[name] != wanted[name]:
      raise ConfigError(
        f"checkpoints in {checkpoint_dir} hold '{name}' with shape {saved[name]}, this config needs {wanted[name]}; use a new run_name or the config they were written with"
      )
  return None


def _another_state(item: epath.Path, checkpoint_dir: str, missing: list[str], extra: list[str], settings: dict[str, Any] | None) -> str:
  """The one line for checkpoints holding another train state than the config builds: the settings that changed
  (when the step's manifest recorded them), else the arrays that differ, and the two ways on."""
  manifest, _ = read_manifest(item.parent)
  recorded = manifest["settings"] if manifest else {}
  changed = [k for k in MANIFEST_SETTINGS if settings and k in recorded and k in settings and recorded[k] != settings[k] and k != "load_parameters_path"]
  if changed:
    what = (
      "they were written with " + ", ".join(f"{k}={recorded[k]}" for k in changed) + "; this config has " + ", ".join(f"{k}={settings[k]}" for k in changed)
    )
  else:
    parts = []
    if extra:
      parts.append(f"they hold {shorten([repr(n) for n in extra], 2)}, which this config's state lacks")
    if missing:
      parts.append(f"they lack {shorten([repr(n) for n in missing], 2)}, which this config needs")
    what = "; ".join(parts)
  lora = recorded.get("lora.enable_lora", settings.get("lora.enable_lora") if settings else False)
  restart = f"lora.lora_restore_path={item} (fresh optimizer, step 0)" if lora else f"load_parameters_path={item} (fresh optimizer, step 0)"
  return (
    f"checkpoints in {checkpoint_dir} hold another train state than this config builds ({what}); nothing was moved. Resume with the settings "
    f"they were written with, or start a new run from their parameters: run_name=<new name> {restart}"
  )
