"""DataIterator: this process's grain batches assembled into global, sharded jax.Arrays; resumable by state dict."""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from maxtext import mesh as mesh_lib
from maxtext.config import MaxTextConfig
from maxtext.data import mixture
from maxtext.data.batch_size import batch_key, batch_rows
from maxtext.data.features import ADAPTER_KEY, BATCH_KEYS, IMAGE_KEY, MIXTURE_KEY, NO_ADAPTER
from maxtext.errors import DataError, UserError

STATE_VERSION = 1


class DataIterator:
  """Iterator of global batches: dict of int32 jax.Arrays [global_batch, max_target_length] sharded over the data axes.

  Train data raises StopIteration once num_epoch passes are used up (a normal end of training: the loop saves the last
  step); eval data raises StopIteration at its end (its last partial batch is padded with empty rows, segmentation 0). The first batch is read when the iterator is built,
  so bad data fails before any training step.
  """

  def __init__(
    self,
    dataset,
    config: MaxTextConfig,
    mesh: Mesh,
    split: str,
    description: str,
    process_index: int,
    process_count: int,
    why_empty: str = "",
    mixture_names: tuple[str, ...] = (),
    elastic: bool = False,
  ):
    self.split = split
    self.description = description
    self.process_index, self.process_count = process_index, process_count
    rows = batch_rows(config, split)
    self.local_batch = rows // process_count
    self.elastic = elastic  # grain_use_elastic_iterator: dataset yields global batches; this process keeps its rows
    self.read_rows = rows if elastic else self.local_batch
    self.num_epoch = config.num_epoch
    self.global_shape = (rows, config.max_target_length)
    self.sharding = mesh_lib.data_sharding(config, mesh)
    self.keys = BATCH_KEYS + (ADAPTER_KEY,) if config.lora.adapter_column else BATCH_KEYS
    self.dtypes: dict[str, Any] = {IMAGE_KEY: np.uint8}
    if config.use_multimodal and config.vision_encoder_block == "qwen3_vl":  # each row's image patches, layout and MRoPE positions
      from maxtext.data import qwen3_vl_records

      self.dtypes = qwen3_vl_records.batch_dtypes(config)
      self.keys += tuple(self.dtypes)
    elif config.use_multimodal:  # each token's image chunk, uint8 [rows, length, chunk]
      self.keys += (IMAGE_KEY,)
    self.mixture_names = list(mixture_names)  # a mixture's components: its batches carry MIXTURE_KEY, counted here
    self._mixture_counts = np.zeros(len(mixture_names), np.int64)
    self._dataset = dataset
    self._it = iter(dataset)
    self._batches_read = 0
    self._peeked: dict[str, np.ndarray] | None = None
    self._state_before_peek: dict[str, Any] | None = None
    atexit.register(_close_at_exit, weakref.ref(self))  # stop prefetch threads/workers before interpreter teardown
    self.notes: list[str] = []  # lines about the data for the run's output (e.g. DPO pairs dropped, and why)
    self._peek()
    if self._peeked is None:
      raise DataError(
        f"the {split} data ({description}) yields no batch: {why_empty or 'no documents with text (after dropping empty ones)'} or too few for "
        f"{self.local_batch} rows of {config.max_target_length} tokens; check the files and train_data_columns, or lower {batch_key(config, split)}"
      )

  def __iter__(self) -> DataIterator:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    local = self.next_local()
    return {k: jax.make_array_from_process_local_data(self.sharding, local[k], self.global_shape[:1] + local[k].shape[1:]) for k in self.keys}

  def next_local(self) -> dict[str, np.ndarray]:
    """This process's rows of the next batch as numpy arrays."""
    if self._peeked is not None:
      batch, self._peeked, self._state_before_peek = self._peeked, None, None
    else:
      batch = self._read()
    if batch is None:
      raise StopIteration
    self._batches_read += 1
    if self.mixture_names:
      starts = batch.pop(MIXTURE_KEY)
      self._mixture_counts += np.bincount(starts.ravel(), minlength=len(self.mixture_names) + 1)[1:]
    return batch

  def mixture_metrics(self) -> dict[str, float]:
    """{'data/<name>_fraction': ...}: each mixture component's share of the documents in the batches read so far
    (restored with the state, so a resumed run goes on counting); {} without a mixture."""
    return mixture.fractions(self.mixture_names, self._mixture_counts) if self.mixture_names else {}

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position of this process's data (restore it with set_state); elastic: the global position,
    the same on every process and valid for any process count."""
    inner = self._state_before_peek if self._peeked is not None else self._it.get_state()
    state = {
      "version": STATE_VERSION,
      "split": self.split,
      "process_index": None if self.elastic else self.process_index,
      "process_count": None if self.elastic else self.process_count,
      "batches_read": self._batches_read,
      "grain": inner,
    }
    if self.elastic:
      state["global_rows"] = self.read_rows
    if self.mixture_names:
      state["mixture_counts"] = dict(zip(self.mixture_names, self._mixture_counts.tolist()))
    return state

  def set_state(self, state: dict[str, Any]) -> None:
    """Continue from a get_state() dict: the following batches equal those the saved iterator would have given.

    A dict this iterator did not write raises ValueError (damage); a state of another pipeline (other data settings,
    another process layout), DataError. The iterator is unchanged when either is raised."""
    if state.get("version") != STATE_VERSION or state.get("split") != self.split or not isinstance(state.get("batches_read"), int):
      raise ValueError(f"not a {self.split} data-iterator state of version {STATE_VERSION} (version {state.get('version')!r}, split {state.get('split')!r})")
    if self.elastic != ("global_rows" in state):
      saved, now = ("true", "false") if "global_rows" in state else ("false", "true")
      raise DataError(
        f"the saved data position was written with grain_use_elastic_iterator={saved}, this run has {now}; resume with grain_use_elastic_iterator={saved}"
      )
    if not self.elastic and (state.get("process_index"), state.get("process_count")) != (self.process_index, self.process_count):
      raise DataError(
        f"data iterator state was saved by process {state.get('process_index')} of {state.get('process_count')}, "
        f"this is process {self.process_index} of {self.process_count}; resume with the same number of processes (or start runs with grain_use_elastic_iterator=true)"
      )
    counts = state.get("mixture_counts", {})
    if list(counts) != self.mixture_names:
      raise DataError(
        f"the saved data position is of {'a mixture of ' + ', '.join(counts) if counts else 'unmixed data'}, this run reads "
        f"{'a mixture of ' + ', '.join(self.mixture_names) if self.mixture_names else 'unmixed data'}; resume with the data settings it was saved with"
      )
    before = self._it.get_state()
    try:
      self._it.set_state(state["grain"])
    except Exception as e:  # noqa: BLE001 - grain refuses the position of another pipeline in many ways
      self._it.set_state(before)
      first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
      raise DataError(
        f"the saved data position does not fit this data pipeline ({type(e).__name__}: {first}); resume with the data settings it was saved with"
      ) from None
    self._peeked = self._state_before_peek = None
    self._batches_read = state["batches_read"]
    self._mixture_counts = np.asarray([int(counts[name]) for name in self.mixture_names], np.int64)

  def close(self) -> None:
    """Stop prefetch threads and worker processes; the iterator cannot be used afterwards."""
    close = getattr(self._it, "close", None)
    if close is not None:
      close()
    self._it = self._dataset = None

  def _peek(self) -> None:
    self._state_before_peek = self._it.get_state()
    self._peeked = self._read()

  def _read(self) -> dict[str, np.ndarray] | None:
    try:
      batch = next(self._it)
    except StopIteration:
      return None
    except UserError:
      raise
    except Exception as e:
      cause = _user_error_in(e)
      if cause is not None:
        raise cause from None
      raise
    return self._local_rows(batch)

  def _local_rows(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
    """A batch as grain gives it -> this process's int32 rows (a short eval batch padded with empty rows)."""
    keys = self.keys + (MIXTURE_KEY,) if self.mixture_names else self.keys
    batch = {k: np.asarray(batch[k], self.dtypes.get(k, np.int32)) for k in keys}
    rows = batch["inputs"].shape[0]
    if rows < self.read_rows:  # the last eval batch: pad with empty rows (on the base model)
      batch = {
        k: np.pad(v, ((0, self.read_rows - rows),) + ((0, 0),) * (v.ndim - 1), constant_values=NO_ADAPTER if k == ADAPTER_KEY else 0) for k, v in batch.items()
      }
    if self.elastic:  # this process's rows of the global batch
      first = self.process_index * self.local_batch
      batch = {k: v[first : first + self.local_batch] for k, v in batch.items()}
    return batch


def _close_at_exit(ref: weakref.ref) -> None:
  it = ref()
  if it is not None and it._it is not None:
    it.close()
    gc.collect()  # free grain's iterators while their modules still exist


def _user_error_in(e: BaseException) -> UserError | None:
  """A UserError raised inside a grain worker reaches us wrapped; find it in the cause chain."""
  seen = 0
  while e is not None and seen < 10:
    if isinstance(e, UserError):
      return e
    e = e.__cause__ or e.__context__
    seen += 1
  return None
