"""GRPO's prompt batches: each process reads its share of the records (maxtext.data.prompts encodes them), shuffled
and repeated as for training rows; a batch is a list of global_batch / num_generations / processes prompts."""

from __future__ import annotations

from jax.sharding import Mesh

from maxtext.config import MaxTextConfig
from maxtext.data.iterator import DataIterator
from maxtext.data.pipeline import encoded_documents, prefetched
from maxtext.data.prompts import Prompt
from maxtext.errors import ConfigError


def local_prompt_count(config: MaxTextConfig, process_count: int) -> int:
  """Prompts each process reads per step: the global batch of rows holds num_generations completions of each."""
  prompts = config.global_batch_size_to_train_on // config.num_generations
  if prompts % process_count:
    raise ConfigError(
      f"use_grpo: {prompts} prompts per step (global batch / num_generations) do not split over {process_count} processes; change per_device_batch_size"
    )
  return prompts // process_count


class PromptIterator(DataIterator):
  """Lists of this process's prompts, one list per step; resumable by state dict like the row iterator."""

  def __init__(self, dataset, config: MaxTextConfig, mesh: Mesh, split: str, description: str, process_index: int, process_count: int):
    self.prompts_per_step = local_prompt_count(config, process_count)
    super().__init__(dataset, config, mesh, split, description, process_index, process_count)

  def __next__(self) -> list[Prompt]:
    return self.next_local()

  def _local_rows(self, batch: list[Prompt]) -> list[Prompt]:
    return list(batch)


def create_prompt_iterator(config: MaxTextConfig, mesh: Mesh, split: str, process_index: int, process_count: int) -> PromptIterator:
  ds, source = encoded_documents(config, split, process_index, process_count)
  ds = prefetched(config, ds.batch(local_prompt_count(config, process_count), drop_remainder=True, batch_fn=list), source)
  return PromptIterator(ds, config, mesh, split, source.description, process_index, process_count)
