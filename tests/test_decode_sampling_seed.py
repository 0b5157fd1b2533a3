"""decode_sampling_seed: the same seed samples the same tokens, another seed another sequence (weighted and top-k)."""

from __future__ import annotations

import pytest

from maxtext.config import from_overrides
from maxtext.inference.generate import Generator
from maxtext.inference.sampling import SamplingParams
from tests.test_decode import perturbed
from tests.test_train_helpers import TINY_MODEL

TINY = dict(
  TINY_MODEL,
  dtype="float32",
  max_target_length=20,
  max_prefill_predict_length=4,
  num_devices=1,
  decode_sampling_temperature=2.0,  # flat distributions: two seeds agreeing on 16 tokens by chance is negligible
  decode_sampling_top_k=16,
)
PROMPTS = [[5, 9, 2], [11, 3, 7]]


@pytest.mark.parametrize("strategy", ["weighted", "topk"])
def test_same_seed_same_tokens_other_seed_other_tokens(strategy):
  config = from_overrides(**TINY, decode_sampling_strategy=strategy)
  gen = Generator(perturbed(config), SamplingParams.from_config(config), config=config)  # what `python -m maxtext.decode` builds

  def sampled(seed: int) -> list[list[int]]:
    seeded = config.model_copy(update={"decode_sampling_seed": seed})
    return gen.generate(PROMPTS, seed=seeded.decode_sampling_seed).tokens  # as the decode command passes it

  first, again, other = sampled(7), sampled(7), sampled(8)
  assert [len(t) for t in first] == [17, 17]  # no eos: each row fills max_target_length - its prompt's 3 tokens
  assert first == again
  assert first != other
