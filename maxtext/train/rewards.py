"""GRPO reward functions: loading `module:function` entries, calling them safely, and a few ready-made ones.

A reward function is called once per rollout batch as `fn(prompts, completions, **columns)`: prompts and
completions are lists of strings, one per completion (a prompt repeats num_generations times), and each column
of the prompt records is a keyword argument holding that column's values, aligned with the completions. It
returns one number per completion: a flat list, tuple or 1-D array of ints, floats or bools. Each call gets its
own copy of the arguments. An exception (sys.exit included), a nested list, strings, a wrong count or a
non-finite value stops the run with one line naming the function and, where one is at fault, the data row.
The trainer runs the functions in a worker process, bounded in time and memory (maxtext.train.reward_worker).
"""

from __future__ import annotations

import dataclasses
import importlib
import numbers
import pickle
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from maxtext.errors import ConfigError, DataError, echo

RewardFn = Callable[..., Sequence[float]]


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str  # the config entry, 'module:function'
  fn: RewardFn
  weight: float

  @property
  def short_name(self) -> str:
    """The function's name, as metrics call it (reward/<name>/mean)."""
    return self.name.rsplit(":", 1)[-1]


def short_names(entries: Sequence[str]) -> list[str]:
  """The function names of grpo_reward_functions entries (without importing them); a ConfigError for an entry that is
  not 'module:function' or for two functions of the same name."""
  names = []
  for entry in entries:
    module_name, sep, attr = str(entry).partition(":")
    if not sep or not module_name or not attr:
      raise ConfigError(f"grpo_reward_functions entry {entry!r} is not 'module:function'; write e.g. maxtext.train.rewards:contains_target")
    names.append(attr)
  if len(set(names)) != len(names):
    raise ConfigError(f"grpo_reward_functions {list(entries)} has two functions of the same name; their metrics would collide, rename one")
  return names


def load(entries: Sequence[str], weights: Sequence[float] = ()) -> list[Reward]:
  """The reward functions grpo_reward_functions names, imported now; any entry that does not import is a ConfigError."""
  short_names(entries)
  rewards = []
  for i, entry in enumerate(entries):
    module_name, _, attr = str(entry).partition(":")
    try:
      module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure to import the user's module is the same config error
      raise ConfigError(
        f"grpo_reward_functions entry '{entry}': module '{module_name}' does not import ({type(e).__name__}: {_one_line(e)}); "
        "fix the module path (it is imported from the working directory and PYTHONPATH)"
      ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
      raise ConfigError(f"grpo_reward_functions entry '{entry}': module '{module_name}' has no function '{attr}'; fix the function name")
    rewards.append(Reward(str(entry), fn, float(weights[i]) if weights else 1.0))
  return rewards


def score(
  reward: Reward, prompts: list[str], completions: list[str], columns: dict[str, list[Any]], where: list[str], memory_limit: str = "the host's memory"
) -> np.ndarray:
  """float64 [completions] from one reward function, called on a copy of its arguments; DataError naming the function
  (and the row) on any failure. memory_limit: what a MemoryError ran into, for the message."""
  arguments = pickle.dumps((prompts, completions, columns))  # each call unpickles its own copy: a function may mutate it
  try:
    values = _call(reward, arguments, slice(None))
  except MemoryError:
    raise DataError(f"reward function '{reward.name}' ran out of memory ({memory_limit}); lower its memory use or raise grpo_reward_memory_gib") from None
  except (Exception, SystemExit) as e:  # noqa: BLE001 - a reward that raises (or calls sys.exit) is reported with its row, never as a traceback
    row = _failing_row(reward, arguments, len(completions))
    at = f" on {where[row]} (completion {row})" if row is not None else ""
    raise DataError(f"reward function '{reward.name}' {_what_happened(e)}{at}; fix the function or the data") from None
  return as_scores(reward.name, values, len(completions), where)


def as_scores(name: str, values: Any, count: int, where: list[str]) -> np.ndarray:
  """A reward function's return value -> float64 [count]; anything but one finite number per completion (a nested
  list, strings, another count) is a DataError naming the function and what it returned."""
  returned = f"reward function '{name}' returned {' '.join(echo(values, 100).split())}"
  if isinstance(values, (str, bytes, dict)) or not (isinstance(values, (list, tuple)) or hasattr(values, "__array__")):
    raise DataError(f"{returned}, a {type(values).__name__}; return a list of one float per completion")
  try:
    array = np.asarray(values)
  except (TypeError, ValueError):  # ragged nesting
    raise DataError(f"{returned}, not a flat list of numbers; return a list of one float per completion") from None
  if array.ndim != 1:
    raise DataError(f"{returned}, values of shape {array.shape}, not a flat list; return a list of one float per completion")
  if array.dtype.kind not in "biuf":
    items = list(values) if isinstance(values, (list, tuple)) else array.tolist()
    bad = next((v for v in items if not isinstance(v, numbers.Real)), None)
    if bad is None:  # e.g. ints too large for a float
      raise DataError(f"{returned}, values that do not fit a float64; return a list of one float per completion")
    hint = " (a number, not its text)" if isinstance(bad, (str, bytes)) else ""
    raise DataError(f"{returned}: {echo(bad, 60)} is a {type(bad).__name__}, not a number; return a list of one float per completion{hint}")
  if array.shape[0] != count:
    raise DataError(f"reward function '{name}' returned {array.shape[0]} values for {count} completions; return one float per completion")
  out = array.astype(np.float64)
  bad = np.flatnonzero(~np.isfinite(out))
  if bad.size:
    i = int(bad[0])
    raise DataError(f"reward function '{name}' returned {out[i]} for {where[i]} (completion {i}); return a finite float for every completion")
  return out


def mean_and_std(values: np.ndarray, axis: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Mean and population std of finite float64 values along axis (kept as a size-1 axis; None: over all), computed on values / max |value| so
  that no intermediate overflows: rewards of +-1e300 have mean 0 and std 1e300, not inf."""
  values = np.asarray(values, np.float64)
  scale = np.max(np.abs(values), axis=axis, keepdims=axis is not None)
  scale = np.where(scale > 0, scale, 1.0)
  scaled = values / scale
  return scaled.mean(axis=axis, keepdims=axis is not None) * scale, scaled.std(axis=axis, keepdims=axis is not None) * scale


def _call(reward: Reward, arguments: bytes, rows: slice) -> Any:
  prompts, completions, columns = pickle.loads(arguments)
  return reward.fn(prompts[rows], completions[rows], **{k: v[rows] for k, v in columns.items()})


def _failing_row(reward: Reward, arguments: bytes, count: int) -> int | None:
  """The first completion the function raises on when called on it alone (None if every single row passes)."""
  for i in range(count):
    try:
      _call(reward, arguments, slice(i, i + 1))
    except (Exception, SystemExit):  # noqa: BLE001
      return i
  return None


def _what_happened(e: BaseException) -> str:
  if isinstance(e, SystemExit):
    return f"called sys.exit({e.code!r}) (a reward function must return its scores, not end the process)"
  return f"raised {type(e).__name__}: {_one_line(e)}"


def _one_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else "(no message)"


# --- ready-made rewards (used by docs/post_training.md and the benchmarks) --------------------------------------

_WORD = re.compile(r"[a-z0-9_]+")


def contains_target(prompts: list[str], completions: list[str], target: list[str], **_: Any) -> list[float]:
  """1.0 when the completion contains the row's `target` column (a word or string), else 0.0."""
  return [float(str(t) in c) for c, t in zip(completions, target)]


def topic_overlap(prompts: list[str], completions: list[str], text: list[str], **_: Any) -> list[float]:
  """The share of the completion's words that occur in the row's `text` column (the embedded corpus topic it starts):
  1.0 for a completion that stays on its topic's vocabulary, 0.0 for an empty or unrelated one."""
  out = []
  for c, t in zip(completions, text):
    words = _WORD.findall(c.lower())
    vocabulary = set(_WORD.findall(str(t).lower()))
    out.append(sum(w in vocabulary for w in words) / len(words) if words else 0.0)
  return out
