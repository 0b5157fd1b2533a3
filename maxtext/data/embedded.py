"""The embedded corpus: Python's reference documentation topics (pydoc_data.topics), shipped with the interpreter.

Every 10th topic (sorted by name) is held out as the eval split. With no tokenizer_path, a sentencepiece tokenizer
of vocab_size tokens is trained on the train topics on first use and cached under base_output_directory.

Each record holds the topic as 'text', and for post-training (docs/post_training.md) 'prompt' (its first
PROMPT_WORDS words), 'chosen' (the next RESPONSE_WORDS words) and 'rejected' (those words in a shuffled order):
preference pairs of fluent over scrambled text, and prompts whose rewards may read the topic.
"""

from __future__ import annotations

import os

import grain
import numpy as np

from maxtext.data.sources import Source
from maxtext.tokenizer.train import train_sentencepiece

EVAL_EVERY = 10
PROMPT_WORDS = 8
RESPONSE_WORDS = 12


def record(index: int, text: str) -> dict[str, str]:
  """{'text', 'prompt', 'chosen', 'rejected'} of a topic (rejected: chosen's words permuted, seeded by index)."""
  words = text.split()
  prompt, response = words[:PROMPT_WORDS], words[PROMPT_WORDS : PROMPT_WORDS + RESPONSE_WORDS]
  order = np.random.default_rng(index).permutation(len(response))
  if len(response) > 1 and np.array_equal(order, np.arange(len(response))):
    order = np.roll(order, 1)
  return {"text": text, "prompt": " ".join(prompt), "chosen": " ".join(response), "rejected": " ".join(response[i] for i in order)}


def documents(split: str) -> list[tuple[str, dict[str, str]]]:
  """(where, record) of each topic in the split."""
  from pydoc_data.topics import topics

  names = sorted(topics)
  held_out = split != "train"
  return [(f"pydoc_data topic '{name}'", record(i, topics[name])) for i, name in enumerate(names) if (i % EVAL_EVERY == 0) == held_out]


def source(split: str) -> Source:
  return Source(grain.MapDataset.source(documents(split)), f"embedded pydoc_data topics ({split})")


def tokenizer_size(config) -> int:
  """The trained tokenizer's vocabulary: vocab_size, or with use_multimodal image_token_id (the ids from it up stay free
  for image placeholders)."""
  return config.image_token_id if config.use_multimodal else config.vocab_size


def tokenizer_cache_path(base_output_directory: str, vocab_size: int) -> str:
  return os.path.join(base_output_directory, "tokenizers", f"pydoc_topics_sp{vocab_size}.model")


def cached_tokenizer(base_output_directory: str, vocab_size: int) -> str:
  """Path of the sentencepiece model for the embedded corpus, trained (once) if missing."""
  path = tokenizer_cache_path(base_output_directory, vocab_size)
  if not os.path.exists(path):
    texts = [doc["text"] for _, doc in documents("train")]
    train_sentencepiece(texts, vocab_size, path)
  return path
