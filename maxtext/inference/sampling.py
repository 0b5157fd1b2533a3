"""Next-token sampling with MaxText's decode_sampling_* semantics: greedy, weighted, topk, nucleus."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from maxtext.errors import ConfigError

Strategy = Literal["greedy", "weighted", "topk", "nucleus"]
NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  strategy: Strategy = "greedy"
  temperature: float = 1.0  # logits are divided by it (weighted, topk, nucleus)
  top_k: int = 0  # topk: sample among the k most likely tokens
  nucleus_p: float = -1.0  # nucleus: sample among the smallest set of tokens whose probability reaches p

  def __post_init__(self):
    if self.strategy not in ("greedy", "weighted", "topk", "nucleus"):
      raise ConfigError(f"decode_sampling_strategy '{self.strategy}' is not one of greedy, weighted, topk, nucleus")
    if self.strategy != "greedy" and not self.temperature > 0:
      raise ConfigError(f"decode_sampling_temperature must be > 0 for {self.strategy} sampling, got {self.temperature}")
    if self.strategy == "topk" and self.top_k < 1:
      raise ConfigError(f"decode_sampling_strategy=topk needs decode_sampling_top_k >= 1, got {self.top_k}")
    if self.strategy == "nucleus" and not 0 < self.nucleus_p <= 1:
      raise ConfigError(f"decode_sampling_strategy=nucleus needs 0 < decode_sampling_nucleus_p <= 1, got {self.nucleus_p}")

  @classmethod
  def from_config(cls, config) -> SamplingParams:
    return cls(config.decode_sampling_strategy, config.decode_sampling_temperature, config.decode_sampling_top_k, config.decode_sampling_nucleus_p)


def allowed_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """float32 logits [B, V] / temperature, with every token the strategy excludes set to -inf-like NEG_INF."""
  logits = logits.astype(jnp.float32) / params.temperature
  if params.strategy == "topk":
    kth = jax.lax.top_k(logits, min(params.top_k, logits.shape[-1]))[0][..., -1:]
    return jnp.where(logits >= kth, logits, NEG_INF)
  if params.strategy == "nucleus":
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the strictly more likely tokens
    keep = before < params.nucleus_p  # the most likely token always stays
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, NEG_INF)
  return logits


def mask_padding(logits: jax.Array, tokenizer_vocab_size: int | None) -> jax.Array:
  """float32 logits [B, V] with the ids >= tokenizer_vocab_size set to NEG_INF: a padded vocabulary's extra ids (the
  model's vocab_size rounded up past the tokenizer's) have no piece to decode, so no strategy may pick them."""
  logits = logits.astype(jnp.float32)
  if tokenizer_vocab_size is None or tokenizer_vocab_size >= logits.shape[-1]:
    return logits
  return jnp.where(jnp.arange(logits.shape[-1]) < tokenizer_vocab_size, logits, NEG_INF)


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams, tokenizer_vocab_size: int | None = None) -> jax.Array:
  """logits [B, V] -> next tokens [B] int32, never an id >= tokenizer_vocab_size (None: every id of the model may be drawn)."""
  logits = mask_padding(logits, tokenizer_vocab_size)
  if params.strategy == "greedy":
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, allowed_logits(logits, params), axis=-1).astype(jnp.int32)
