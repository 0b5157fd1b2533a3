"""GRPO reward functions: loading `module:function` entries, calling them safely, and a few ready-made ones.

A reward function is called once per rollout batch as `fn(prompts, completions, **columns)`: prompts and
completions are lists of strings, one per completion (a prompt repeats num_generations times), and each column
of the prompt records is a keyword argument holding that column's values, aligned with the completions. It
returns one number per completion. An exception, a wrong count or a non-finite value stops the run with one
line naming the function and the data row.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from maxtext.errors import ConfigError, DataError

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


def load(entries: Sequence[str], weights: Sequence[float] = ()) -> list[Reward]:
  """The reward functions grpo_reward_functions names, imported now; any entry that does not import is a ConfigError."""
  rewards = []
  for i, entry in enumerate(entries):
    module_name, sep, attr = str(entry).partition(":")
    if not sep or not module_name or not attr:
      raise ConfigError(f"grpo_reward_functions entry {entry!r} is not 'module:function'; write e.g. maxtext.train.rewards:contains_target")
    try:
      module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure to import the user's module is the same config error
      raise ConfigError(
        f"grpo_reward_functions entry '{entry}': module '{module_name}' does not import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
        "fix the module path (it is imported from the working directory and PYTHONPATH)"
      ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
      raise ConfigError(f"grpo_reward_functions entry '{entry}': module '{module_name}' has no function '{attr}'; fix the function name")
    rewards.append(Reward(str(entry), fn, float(weights[i]) if weights else 1.0))
  if len({r.short_name for r in rewards}) != len(rewards):
    raise ConfigError(f"grpo_reward_functions {list(entries)} has two functions of the same name; their metrics would collide, rename one")
  return rewards


def score(reward: Reward, prompts: list[str], completions: list[str], columns: dict[str, list[Any]], where: list[str]) -> np.ndarray:
  """float64 [completions] from one reward function; DataError naming the function and the row on any failure."""
  try:
    values = reward.fn(prompts, completions, **columns)
  except Exception as e:  # noqa: BLE001 - a reward that raises is reported with its row, never as a traceback
    row = _failing_row(reward, prompts, completions, columns)
    at = f" on {where[row]} (completion {row})" if row is not None else ""
    raise DataError(f"reward function '{reward.name}' raised {type(e).__name__}: {_one_line(e)}{at}; fix the function or the data") from None
  try:
    out = np.asarray(values, np.float64).reshape(-1)
  except (TypeError, ValueError):
    raise DataError(f"reward function '{reward.name}' returned {type(values).__name__} values that are not numbers; return one float per completion") from None
  if out.shape[0] != len(completions):
    raise DataError(f"reward function '{reward.name}' returned {out.shape[0]} values for {len(completions)} completions; return one float per completion")
  bad = np.flatnonzero(~np.isfinite(out))
  if bad.size:
    i = int(bad[0])
    raise DataError(f"reward function '{reward.name}' returned {out[i]} for {where[i]} (completion {i}); return a finite float for every completion")
  return out


def _failing_row(reward: Reward, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> int | None:
  """The first completion the function raises on when called on it alone (None if every single row passes)."""
  for i in range(len(completions)):
    try:
      reward.fn(prompts[i : i + 1], completions[i : i + 1], **{k: v[i : i + 1] for k, v in columns.items()})
    except Exception:  # noqa: BLE001
      return i
  return None


def _one_line(e: Exception) -> str:
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
