"""Data mixtures: documents drawn from several sources with given weights (MaxText's syntax).

- `grain_train_files` / `hf_train_files` = `glob,weight;glob,weight;...` (a `;` makes it a mixture);
- `grain_train_mixture_config_path` = a JSON file `{"<name>": {"path": "<glob>", "weight": <w>}, ...}`.

Each draw picks a component with probability weight / sum(weights), from a random stream seeded by
(data_shuffle_seed, process index), and takes that component's next document (its own shuffled pass over its files,
this process's share). `mixture_exhaustion` says what a component that runs out does: `stop` ends the data once a
component has had num_epoch passes; `repeat` starts it on a new, reshuffled pass, and the data ends once every
component (with weight > 0) has had num_epoch passes. The iterator state holds every component's position, so a
resumed mixture continues exactly. Documents carry their component on their first token (features.MIXTURE_KEY) so the
DataIterator can count the realised fractions.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import grain
import grain.experimental as gx
import numpy as np

from maxtext.data import sources
from maxtext.data.features import MIXTURE_KEY
from maxtext.errors import ConfigError, DataError, echo

# Components are read in the caller's thread (the mixture as a whole has a prefetch thread): no thread pool per pass.
SYNCHRONOUS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
DRAWS_PER_BLOCK = 4096  # component choices drawn at once; block b comes from its own seed, so any draw is reproducible


@dataclass(frozen=True)
class Component:
  name: str
  pattern: str
  weight: float


def components(config, split: str) -> list[Component]:
  """The split's mixture components, or [] when it reads a single source. Bad syntax or weights are ConfigErrors."""
  kind = config.dataset_type
  if split != "train":
    key = {"grain": "grain_eval_files", "hf": "hf_eval_files"}.get(kind)
    if key and ";" in getattr(config, key):
      raise ConfigError(f"{key} is a weighted mixture ('glob,weight;...'); eval data reads one set of files, so give {key} plain globs")
    return []
  if config.grain_train_mixture_config_path and kind == "grain":
    found = _from_json(config.grain_train_mixture_config_path)
    key = "grain_train_mixture_config_path"
  else:
    key = {"grain": "grain_train_files", "hf": "hf_train_files"}.get(kind)
    if key is None or ";" not in getattr(config, key):
      return []
    found = _from_string(key, getattr(config, key))
  _check_weights(key, found)
  if config.use_dpo or config.use_grpo:
    raise ConfigError(f"{key} is a mixture, which pretraining and SFT read; DPO and GRPO read one set of files, so give {key} plain globs")
  if not 0 <= config.data_shuffle_seed < 2**32:
    raise ConfigError(f"invalid value for 'data_shuffle_seed': {config.data_shuffle_seed}; use an integer in [0, 2**32)")
  return found


def _from_string(key: str, value: str) -> list[Component]:
  """'globs,weight;globs,weight' -> components named after their glob (see component_name)."""
  found: list[Component] = []
  names: set[str] = set()
  for part in (p.strip() for p in value.split(";")):
    if not part:
      continue
    pattern, comma, weight = part.rpartition(",")
    if not comma or not pattern.strip():
      raise ConfigError(f"{key} component {echo(part)} has no weight; write {key}='glob,weight;glob,weight'")
    name = component_name(pattern, len(found), names)
    names.add(name)
    found.append(Component(name, pattern.strip(), _weight(key, name, weight)))
  if not found:
    raise ConfigError(f"{key} {echo(value)} names no component; write {key}='glob,weight;glob,weight'")
  return found


def component_name(pattern: str, index: int, taken: set[str]) -> str:
  """A metric-friendly name from the glob's last part with a name in it ('/data/web-*.jsonl' and '/data/web/*.jsonl' ->
  'web'); 'component<index>' if there is none or it is taken."""
  for part in reversed(pattern.split(",")[0].split(os.sep)):
    name = re.sub(r"[^A-Za-z0-9_]+", "_", re.sub(r"\[[^\]]*\]|[*?]", "", part.split(".")[0])).strip("_")
    if name:
      return name if name not in taken else f"component{index}"
  return f"component{index}"


def _from_json(path: str) -> list[Component]:
  key = "grain_train_mixture_config_path"
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except OSError as e:
    raise ConfigError(f"{key} '{path}' cannot be read ({e.strerror or type(e).__name__}); fix the path") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(f"{key} '{path}' is not valid JSON ({getattr(e, 'msg', type(e).__name__)}); fix the file") from None
  shape = '{"<name>": {"path": "<glob>", "weight": <number>}, ...}'
  if not isinstance(data, dict) or not data:
    raise ConfigError(f"{key} '{path}' must hold a non-empty JSON object {shape}")
  found = []
  for name, entry in data.items():
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"].strip() or "weight" not in entry:
      raise ConfigError(f'{key} \'{path}\': component {echo(name)} must be {{"path": "<glob>", "weight": <number>}}; fix the file')
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
      raise ConfigError(f"{key} '{path}': component name {echo(name)} must be letters, digits, '_', '.' or '-' (it names a metric); rename it")
    found.append(Component(name, entry["path"].strip(), _weight(f"{key} '{path}'", name, entry["weight"])))
  return found


def _weight(where: str, name: str, value: Any) -> float:
  try:
    weight = float(value) if not isinstance(value, bool) else math.nan
  except (TypeError, ValueError):
    weight = math.nan
  if not math.isfinite(weight) or weight < 0:
    raise ConfigError(f"{where}: component '{name}' has weight {echo(value)}; give each component a finite weight >= 0")
  return weight


def _check_weights(where: str, found: list[Component]) -> None:
  total = sum(c.weight for c in found)
  if not total > 0:
    raise ConfigError(f"{where}: the weights of components {', '.join(c.name for c in found)} sum to {total}; give at least one a positive weight")


# --- the mixed stream of documents ------------------------------------------------------------


class ComponentDocuments:
  """One component's documents for this process: pass p is a pass over its files, shuffled with a seed of its own."""

  def __init__(self, source: sources.Source, encoder: Any, index: int, shuffle: bool, seed: int, window: int):
    self.source, self.encoder, self.index = source, encoder, index
    self.shuffle, self.seed, self.window = shuffle, seed, window

  def dataset(self, pass_index: int, process_index: int, process_count: int) -> grain.IterDataset:
    seed = int(np.random.SeedSequence([self.seed, self.index, pass_index]).generate_state(1)[0])
    ds: Any = self.source.dataset
    if self.source.random_access:
      if self.shuffle:
        ds = ds.shuffle(seed=seed)
      share = sources.process_share(len(ds), process_index, process_count)
      ds = ds[share.start : share.stop : share.step].map(self.encoder).filter(_is_document).to_iter_dataset(SYNCHRONOUS)
    else:  # streamed: already this process's share
      if self.shuffle:
        ds = gx.WindowShuffleIterDataset(ds, window_size=self.window, seed=seed)
      ds = ds.map(self.encoder).filter(_is_document)
    return ds.map(MarkComponent(self.index + 1))


def _is_document(doc: Any) -> bool:
  return doc is not None


class MarkComponent:
  """Adds MIXTURE_KEY to a document: `number` on its first token, 0 on the others."""

  def __init__(self, number: int):
    self.number = number

  def __call__(self, doc: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    marks = np.zeros(len(doc["tokens"]), np.int32)
    marks[0] = self.number
    return {**doc, MIXTURE_KEY: marks}


class MixtureDataset(grain.IterDataset):
  """Documents drawn from the components with probabilities proportional to their weights (see the module docstring)."""

  def __init__(
    self, parts: list[ComponentDocuments], found: list[Component], seed: int, num_epoch: int, exhaustion: str, process_index: int, process_count: int
  ):
    super().__init__()
    self.parts, self.names = parts, [c.name for c in found]
    weights = np.asarray([c.weight for c in found], np.float64)
    self.probabilities = weights / weights.sum()
    self.seed, self.num_epoch, self.exhaustion = seed, num_epoch, exhaustion
    self.process_index, self.process_count = process_index, process_count

  def __iter__(self) -> grain.DatasetIterator:
    return MixtureIterator(self)


class MixtureIterator(grain.DatasetIterator):
  def __init__(self, mixture: MixtureDataset):
    super().__init__()
    self._m = mixture
    n = len(mixture.parts)
    self._draws = 0
    self._passes = [0] * n  # the pass each component is on
    self._yielded = [False] * n  # whether that pass gave a document yet
    self._its = [self._open(k) for k in range(n)]
    self._block_index, self._block = -1, np.zeros(0, np.int64)

  def _open(self, k: int) -> grain.DatasetIterator:
    m = self._m
    return iter(m.parts[k].dataset(self._passes[k], m.process_index, m.process_count))

  def _choice(self, draw: int) -> int:
    block, i = divmod(draw, DRAWS_PER_BLOCK)
    if block != self._block_index:
      m = self._m
      rng = np.random.default_rng([m.seed, m.process_index, block])
      self._block, self._block_index = rng.choice(len(m.parts), size=DRAWS_PER_BLOCK, p=m.probabilities), block
    return int(self._block[i])

  def _ended(self) -> bool:
    m = self._m
    used_up = [p >= m.num_epoch for p, w in zip(self._passes, m.probabilities) if w > 0]
    return any(used_up) if m.exhaustion == "stop" else all(used_up)

  def __next__(self) -> dict[str, np.ndarray]:
    while True:
      if self._ended():
        raise StopIteration
      k = self._choice(self._draws)
      try:
        doc = next(self._its[k])
      except StopIteration:
        if not self._yielded[k]:
          raise DataError(
            f"mixture component '{self._m.names[k]}' yields no document (no records with text in this process's share); fix its files or weight"
          ) from None
        self._passes[k] += 1
        self._yielded[k] = False
        if not self._ended():
          self._its[k] = self._open(k)
        continue
      self._yielded[k] = True
      self._draws += 1
      return doc

  def get_state(self) -> dict[str, Any]:
    return {
      "names": list(self._m.names),
      "draws": self._draws,
      "passes": list(self._passes),
      "yielded": list(self._yielded),
      "components": [it.get_state() for it in self._its],
    }

  def set_state(self, state: dict[str, Any]) -> None:
    if state.get("names") != self._m.names:
      raise ValueError(f"the saved mixture has components {state.get('names')}, this one {self._m.names}")
    self._draws, self._passes, self._yielded = int(state["draws"]), list(state["passes"]), list(state["yielded"])
    self._its = [self._open(k) for k in range(len(self._m.parts))]
    for it, inner in zip(self._its, state["components"]):
      it.set_state(inner)


def mixed_documents(config, found: list[Component], encoder: Any, process_index: int, process_count: int) -> sources.Source:
  """The mixture of found's components as one streamed Source of encoded documents (each carrying its component)."""
  kind = config.dataset_type
  key = "grain_train_mixture_config_path" if config.grain_train_mixture_config_path and kind == "grain" else f"{kind}_train_files"
  if kind == "hf" and not config.hf_path:
    raise ConfigError("hf_path is empty; set hf_path to a dataset builder (json, parquet, csv, text) or a local dataset directory")
  parts = []
  for index, c in enumerate(found):
    where = f"{key} component '{c.name}'"
    if kind == "grain":
      source = sources.grain_files_source(config, where, c.pattern)
      if not source.random_access:
        source.dataset = sources.streamed_share(source.dataset, process_index, process_count)
    else:
      source = sources.hf_files_source(config, where, c.pattern, process_index, process_count, 1)
    parts.append(ComponentDocuments(source, encoder, index, config.enable_data_shuffling, config.data_shuffle_seed, config.grain_shuffle_buffer_size))
  dataset = MixtureDataset(parts, found, config.data_shuffle_seed, config.num_epoch, config.mixture_exhaustion, process_index, process_count)
  description = f"mixture of {', '.join(f'{c.name} ({c.weight:g})' for c in found)} from {key}"
  return sources.Source(dataset, description)


def fractions(names: list[str], counts: np.ndarray) -> dict[str, float]:
  """{'data/<name>_fraction': share of the documents drawn so far} (0 before the first)."""
  total = int(counts.sum())
  return {f"data/{name}_fraction": (float(count) / total if total else 0.0) for name, count in zip(names, counts)}


def data_metrics(data_iter: Any) -> dict[str, float]:
  """The metrics a data iterator adds to each step (a mixture's fractions); {} for any other iterator."""
  metrics = getattr(data_iter, "mixture_metrics", None)
  return metrics() if metrics is not None else {}
