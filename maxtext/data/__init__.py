"""Input pipeline: `create_iterator(config, mesh, split) -> DataIterator` of global, sharded batches (see docs/data.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from maxtext.data.batch_size import batch_key, batch_rows
from maxtext.errors import ConfigError, DataError

if TYPE_CHECKING:
  from jax.sharding import Mesh

  from maxtext.config import MaxTextConfig
  from maxtext.data.iterator import DataIterator

SPLITS = ("train", "eval")


def create_iterator(config: MaxTextConfig, mesh: Mesh, split: str = "train") -> DataIterator:
  """Global batches of `split` ('train' or 'eval') for config.dataset_type; this process reads only its share."""
  import jax

  if split not in SPLITS:
    raise ConfigError(f"unknown data split '{split}'; use 'train' or 'eval'")
  if config.dataset_type == "synthetic":
    from maxtext.data.synthetic import SyntheticIterator

    return SyntheticIterator(config, mesh, split)

  from maxtext.data.iterator import DataIterator
  from maxtext.data.pipeline import local_batches

  process_index, process_count = jax.process_index(), jax.process_count()
  if config.use_grpo:  # GRPO reads prompts; its rows are sampled (maxtext.train.grpo)
    from maxtext.data.prompt_iterator import create_prompt_iterator

    return create_prompt_iterator(config, mesh, split, process_index, process_count)
  local_batch = local_batch_size(config, mesh, process_count, split)
  from maxtext.data.mixture import components

  names = tuple(c.name for c in components(config, split))  # a weighted mixture's components (checked here first)
  notes, why_empty = [], ""
  if config.use_dpo:  # dropped pairs are counted and named, not lost silently
    notes, why_empty = dpo_notes(config, split, process_index, process_count)
  if config.grain_use_elastic_iterator:  # every process reads the global batches, so the data position is global
    dataset, description = local_batches(config, split, 0, 1, local_batch * process_count)
  else:
    dataset, description = local_batches(config, split, process_index, process_count, local_batch)
  iterator = DataIterator(dataset, config, mesh, split, description, process_index, process_count, why_empty, names, config.grain_use_elastic_iterator)
  iterator.notes = notes
  return iterator


def dpo_notes(config: MaxTextConfig, split: str, process_index: int, process_count: int) -> tuple[list[str], str]:
  """The line that counts split's dropped pairs by reason (none when none is dropped), and what an empty split lacks;
  a DataError when no pair of the split is usable."""
  from maxtext.data.pipeline import survey_pairs

  survey = survey_pairs(config, split, process_index, process_count)
  reasons = survey.reasons()
  if not reasons:
    return [], ""
  if survey.none_usable():
    raise DataError(
      f"the {split} data ({survey.description}) has no usable DPO pair: {survey.counted()}, {reasons}; fix the pairs (chosen and rejected must differ) or raise max_target_length"
    )
  dropped = sum(survey.dropped.values())
  note = f"{split} data: {dropped} {survey.counted()} {'is' if dropped == 1 else 'are'} dropped: {reasons}"
  return [note], f"{dropped} {survey.counted()} {'is' if dropped == 1 else 'are'} dropped ({reasons})"


def local_batch_size(config: MaxTextConfig, mesh: Mesh, process_count: int, split: str = "train") -> int:
  """Rows each process loads; the global batch must split evenly over processes and the data-sharding axes."""
  rows, size = batch_rows(config, split), batch_key(config, split)
  shards = 1
  for axis in config.data_sharding:
    shards *= mesh.shape.get(axis, 1)
  if rows % shards:
    raise ConfigError(f"global batch of {rows} rows does not split over {shards} data shards ({config.data_sharding}); change {size}")
  if rows % process_count:
    raise ConfigError(f"global batch of {rows} rows does not split over {process_count} processes; change {size}")
  return rows // process_count


__all__ = ["batch_key", "batch_rows", "create_iterator", "local_batch_size"]
