"""Checkpoint files outside a run's Checkpointer: where a step's state lies (item_path, the saved steps), and its
parameters read and written by themselves (load_parameters_path, converters, LoRA and decode loading): shapes from
the metadata alone, a restore of all or some of them into their shardings, a params-only save.

Every problem a user can cause (a path that is not a checkpoint, a parameter it lacks or holds in another shape,
arrays that do not read) is a one-line ConfigError naming the config key and the fix.
"""

from __future__ import annotations

import gc
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from maxtext.errors import ConfigError
from maxtext.train import outputs

ITEM = "items"  # the full train state's Orbax item in each step directory


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


def restore_params(path: str, abstract_params: Any, what: str = "load_parameters_path") -> Any:
  """Only the 'params' subtree of a checkpoint, into the shardings abstract_params carries. Callers have matched
  the checkpoint's metadata against abstract_params (match_params), so arrays that then fail to read are damage:
  a one-line ConfigError naming the checkpoint (`what`: the config key that named it)."""
  target = {"params": abstract_params}
  args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      return ckptr.restore(item_path(path), args=args)["params"]
  except Exception as e:  # noqa: BLE001 - a user-named checkpoint whose arrays do not read is damaged
    gc.collect()  # finalize the reads Orbax abandoned (maxtext.errors.ABANDONED_READ_NOISE)
    raise ConfigError(
      f"{what} '{path}' is damaged: its array data does not read ({error_text(e)}); write it again (e.g. rerun the command that made it) or pass another checkpoint"
    ) from None


def save_params(path: str, params: Any) -> None:
  """Write a params-only checkpoint that load_parameters_path accepts (e.g. from a converter)."""
  outputs.check_can_make(path, "the checkpoint")  # Orbax's writer waits forever for a directory it failed to make
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(epath.Path(path), {"params": params})
    ckptr.wait_until_finished()


def first_line(e: Exception) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else type(e).__name__


def error_text(e: BaseException) -> str:
  """The first line of the error's own message, or of the first error in its chain that has a readable one; without
  the repr that TensorStore's read errors end with ('See full TensorStore details: <bound method ...>')."""
  first, seen = e, set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    text = str(e).strip().split(" See full TensorStore details")[0]
    if text and not text.startswith("<"):
      return text.splitlines()[0][:200]
    e = e.__cause__ or e.__context__
  return type(first).__name__


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
    raise ConfigError(f"'{item}' is not a readable checkpoint ({first_line(e)}); pass a checkpoint step directory such as <run>/checkpoints/<step>") from None
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
