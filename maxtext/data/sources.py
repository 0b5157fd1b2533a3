"""Record sources for each dataset_type. Elements are (where, raw record); `where` names file and line/record for errors.

Random-access sources (ArrayRecord, JSONL, TFDS, embedded) are grain MapDatasets: globally shuffled, split by
process, read by optional worker processes. Streamed sources (Parquet, Hugging Face) are grain IterDatasets read
in order (window-shuffled downstream) with each process keeping its share.
"""

from __future__ import annotations

import bisect
import copy
import glob
import json
import mmap
import os
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from maxtext.errors import ConfigError, DataError
from maxtext.tokenizer.tokenizers import one_word


@dataclass
class Source:
  """A split's records: `dataset` is a MapDataset (random access) or an IterDataset (streamed, already this process's share)."""

  dataset: grain.MapDataset | grain.IterDataset
  description: str

  @property
  def random_access(self) -> bool:
    return isinstance(self.dataset, grain.MapDataset)


def process_share(num_records: int, process_index: int, process_count: int) -> range:
  """Indices of the records this process reads: a strided, disjoint, equal share (a remainder of < process_count is dropped)."""
  usable = num_records - num_records % process_count
  return range(process_index, usable, process_count)


def expand_glob(pattern: str, key: str) -> list[str]:
  """Files matching a glob (or comma-separated globs), sorted; nothing matching is a DataError naming the key."""
  files: list[str] = []
  for part in (p.strip() for p in pattern.split(",")):
    matched = sorted(p for p in glob.glob(os.path.expanduser(part)) if os.path.isfile(p)) if part else []
    if not matched:
      raise DataError(f"{key} '{part}' matches no file; fix the path or glob")
    files += matched
  return files


# --- JSONL: random access by line index ---------------------------------------------------------


class JsonlSource:
  """Random access to the lines of JSONL files (an index of line offsets); blank lines are skipped."""

  def __init__(self, files: list[str]):
    self.files = files
    self._starts: list[np.ndarray] = []
    self._ends: list[np.ndarray] = []
    self._lines: list[np.ndarray] = []
    for path in files:
      starts, ends, lines = _index_lines(path)
      self._starts.append(starts)
      self._ends.append(ends)
      self._lines.append(lines)
    self._cumulative = np.cumsum([0] + [len(s) for s in self._starts]).tolist()
    self._handles: dict[int, Any] = {}

  def __len__(self) -> int:
    return self._cumulative[-1]

  def __getitem__(self, index: int) -> tuple[str, Any]:
    f = bisect.bisect_right(self._cumulative, index) - 1
    i = index - self._cumulative[f]
    path, line = self.files[f], int(self._lines[f][i])
    where = f"{path} line {line}"
    start, end = int(self._starts[f][i]), int(self._ends[f][i])
    handle = self._handles.get(f)
    if handle is None:
      handle = self._handles[f] = os.open(path, os.O_RDONLY)
    data = os.pread(handle, end - start, start)
    try:
      record = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise DataError(f"{where}: malformed JSON ({getattr(e, 'msg', type(e).__name__)}); fix or remove the line") from None
    if not isinstance(record, dict):
      raise DataError(f"{where}: a JSON {type(record).__name__}, not an object; each line must be one JSON object") from None
    return where, record

  def __getstate__(self):
    state = self.__dict__.copy()
    state["_handles"] = {}
    return state


def _index_lines(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Byte start/end and 1-based line number of each line that is not blank ('' or a lone '\\r')."""
  try:
    size = os.path.getsize(path)
    if size == 0:
      empty = np.zeros(0, np.int64)
      return empty, empty, empty
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      data = np.frombuffer(m, np.uint8)
      ends = np.flatnonzero(data == 10)
      if len(ends) == 0 or ends[-1] != size - 1:
        ends = np.append(ends, size)
      starts = np.concatenate([[0], ends[:-1] + 1])
      length = ends - starts
      one = np.flatnonzero(length == 1)
      keep = length > 1
      keep[one] = data[starts[one]] != 13
      del data
  except OSError as e:
    raise DataError(f"cannot read '{path}' ({one_word(e)}); check the file and its permissions") from None
  lines = np.arange(1, len(starts) + 1)
  return starts[keep], ends[keep], lines[keep]


# --- grain files ------------------------------------------------------------------------------


def grain_source(config, split: str) -> Source:
  key = "grain_train_files" if split == "train" else "grain_eval_files"
  pattern = getattr(config, key)
  if not pattern:
    raise ConfigError(f"{key} is empty; set {key} to a glob of {config.grain_file_type} files")
  return grain_files_source(config, key, pattern)


def grain_files_source(config, key: str, pattern: str) -> Source:
  """The grain_file_type files matching pattern; `key` names the setting in errors."""
  files = expand_glob(pattern, key)
  kind = config.grain_file_type
  if kind == "jsonl":
    return Source(grain.MapDataset.source(JsonlSource(files)), f"{key} '{pattern}'")
  if kind == "arrayrecord":
    try:
      records = grain.sources.ArrayRecordDataSource(files)
      len(records)
    except Exception as e:  # array_record raises plain RuntimeError/ValueError for bad files
      raise DataError(f"{key} '{pattern}' holds a file that is not ArrayRecord ({one_word(e)}); check grain_file_type") from None
    where = WhereRecord(f"{key} '{pattern}'")
    return Source(grain.MapDataset.source(records).map_with_index(where), f"{key} '{pattern}'")
  return Source(parquet_dataset(files, config, key), f"{key} '{pattern}'")


class WhereRecord:
  """(index, raw) -> ('<prefix> record <index>', raw)."""

  def __init__(self, prefix: str):
    self.prefix = prefix

  def __call__(self, index: int, raw: Any) -> tuple[str, Any]:
    return f"{self.prefix} record {index}", raw


def parquet_dataset(files: list[str], config, key: str) -> grain.IterDataset:
  """Parquet files streamed row by row; columns are checked against the schema of every file first."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  columns = list(config.train_data_columns)
  for path in files:
    try:
      schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as e:
      raise DataError(f"cannot read parquet file '{path}' ({one_word(e)}); check grain_file_type and the file") from None
    for column in columns:
      if column not in schema.names:
        raise DataError(f"{path}: no column '{column}' (columns: {', '.join(schema.names[:8])}); set train_data_columns")
      kind = schema.field(column).type
      text_like = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
      if not (text_like or (config.use_sft and (pa.types.is_list(kind) or pa.types.is_large_list(kind)))):
        raise DataError(f"{path}: column '{column}' is not text ({kind}); set train_data_columns to a text column")
  from grain.experimental import ParquetIterDataset

  return ParquetIterDataset(files).map(WhereFixed(f"{key} (parquet)"))


class WhereFixed:
  def __init__(self, where: str):
    self.where = where

  def __call__(self, raw: Any) -> tuple[str, Any]:
    return self.where, raw


# --- TFDS ------------------------------------------------------------------------------------


def tfds_source(config, split: str) -> Source:
  """A prepared TFDS dataset (array_record format) under dataset_path; read without TensorFlow, never downloaded."""
  name = config.dataset_name if split == "train" or not config.eval_dataset_name else config.eval_dataset_name
  tfds_split = config.train_split if split == "train" else config.eval_split
  if not tfds_split:
    key = "train_split" if split == "train" else "eval_split"
    raise ConfigError(f"{key} is empty; set {key} to a split of {name}")
  import tensorflow_datasets as tfds

  try:
    records = tfds.data_source(name, data_dir=config.dataset_path or None, split=tfds_split, download=False)
  except Exception as e:  # tfds raises DatasetNotFoundError, ValueError, AssertionError, FileNotFoundError
    reason = one_word(e).split(" Available datasets")[0]
    raise DataError(
      f"TFDS dataset '{name}' split '{tfds_split}' is not prepared in array_record format under dataset_path '{config.dataset_path}' ({reason}); "
      "prepare it with file_format=array_record or fix dataset_name/dataset_path"
    ) from None
  where = WhereRecord(f"tfds {name} split {tfds_split}")
  return Source(grain.MapDataset.source(records).map_with_index(where), f"tfds {name} split {tfds_split}")


# --- Hugging Face datasets (streamed) --------------------------------------------------------


def hf_source(config, split: str, process_index: int, process_count: int, num_epoch: int) -> Source:
  key = "hf_train_files" if split == "train" else "hf_eval_files"
  pattern = getattr(config, key)
  if not config.hf_path:
    raise ConfigError("hf_path is empty; set hf_path to a dataset builder (json, parquet, csv, text) or a local dataset directory")
  if split == "eval" and not pattern:
    raise ConfigError("hf_eval_files is empty; set hf_eval_files to a glob of eval files")
  return hf_files_source(config, key, pattern, process_index, process_count, num_epoch)


def hf_files_source(config, key: str, pattern: str, process_index: int, process_count: int, num_epoch: int) -> Source:
  """hf_path streamed over the files matching pattern (all of hf_path's own files when empty); `key` names the setting in errors."""
  files = expand_glob(pattern, key) if pattern else None
  return Source(HFStream(config.hf_path, files, process_index, process_count, num_epoch), f"hf {config.hf_path} {pattern}".strip())


class HFStream(grain.IterDataset):
  """A streamed Hugging Face dataset as a checkpointable grain IterDataset (state: epoch and HF state_dict)."""

  def __init__(self, path: str, files: list[str] | None, process_index: int, process_count: int, num_epoch: int):
    super().__init__()
    self.path, self.files = path, files
    self.process_index, self.process_count, self.num_epoch = process_index, process_count, num_epoch

  def open(self):
    import datasets

    try:
      ds = datasets.load_dataset(self.path, data_files=self.files, split="train", streaming=True)
    except Exception as e:  # datasets raises many types for bad paths and files
      raise DataError(f"hf_path '{self.path}' cannot be loaded with files {self.files} ({one_word(e)}); fix hf_path or the files") from None
    if self.process_count > 1:
      from datasets.distributed import split_dataset_by_node

      ds = split_dataset_by_node(ds, rank=self.process_index, world_size=self.process_count)
    return ds

  def __iter__(self) -> grain.DatasetIterator:
    return HFStreamIterator(self)


class HFStreamIterator(grain.DatasetIterator):
  def __init__(self, stream: HFStream):
    super().__init__()
    self._stream = stream
    self._ds = stream.open()
    self._epoch = 0
    self._count = 0
    self._it = None

  def __next__(self) -> tuple[str, Any]:
    while True:
      if self._it is None:
        self._it = iter(self._ds)
      try:
        record = next(self._it)
      except StopIteration:
        if self._epoch + 1 >= self._stream.num_epoch:
          raise
        self._epoch += 1
        self._count = 0
        self._ds = self._stream.open()
        self._it = None
        continue
      except DataError:
        raise
      except Exception as e:  # a malformed file surfaces while streaming
        raise DataError(f"hf {self._stream.path}: cannot read record {self._count} ({one_word(e)}); fix the data file") from None
      self._count += 1
      return f"hf {self._stream.path} record {self._count - 1} (epoch {self._epoch})", record

  def get_state(self) -> dict[str, Any]:
    return {"epoch": self._epoch, "count": self._count, "hf": copy.deepcopy(self._ds.state_dict())}

  def set_state(self, state: dict[str, Any]) -> None:
    self._ds = self._stream.open()
    self._ds.load_state_dict(copy.deepcopy(state["hf"]))
    self._epoch, self._count = state["epoch"], state["count"]
    self._it = None


def streamed_share(ds: grain.IterDataset, process_index: int, process_count: int) -> grain.IterDataset:
  """This process's share of a streamed source: every process_count-th element, from the process_index-th."""
  return ds if process_count == 1 else StrideIterDataset(ds, process_index, process_count)


class StrideIterDataset(grain.IterDataset):
  """Keeps elements start, start + step, ... of a stream (this process's share of a streamed source)."""

  def __init__(self, parent: grain.IterDataset, start: int, step: int):
    super().__init__(parent)
    self.start, self.step = start, step

  def __iter__(self) -> grain.DatasetIterator:
    return StrideIterator(self._parent.__iter__(), self.start, self.step)


class StrideIterator(grain.DatasetIterator):
  def __init__(self, parent: grain.DatasetIterator, start: int, step: int):
    super().__init__(parent)
    self.start, self.step = start, step

  def __next__(self):
    group = [next(self._parent) for _ in range(self.step)]  # a partial last group raises StopIteration
    return group[self.start]

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state)
