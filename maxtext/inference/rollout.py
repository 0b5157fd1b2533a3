"""GRPO rollouts: completions sampled by the compiled KV-cache decoder from the train state's live parameters.

The decoder (maxtext.inference.generate.Generator) is compiled once, for prompts padded to
max_prefill_predict_length, against the train state's abstract parameters; each call runs it on the parameter
arrays the train step has just updated: no copy of the weights and no second model exist. The layers stay stacked as the train state holds them (decode's
per-layer copy for CPU, `unstack.for_decoding`, is not made). Sampling follows the decode_sampling_* keys and never
draws the ids of a padded vocabulary that the tokenizer cannot decode; each
row's adapter slot (lora.max_lora_adapters > 1) selects the adapter its completions are sampled with.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from maxtext.config import MaxTextConfig
from maxtext.inference.generate import Generator
from maxtext.inference.sampling import SamplingParams


class Rollout:
  """Samples completions for token prompts from given parameters (an nnx Param state and the non-Param state)."""

  def __init__(
    self,
    config: MaxTextConfig,
    graphdef: nnx.GraphDef,
    abstract_params: nnx.State,
    abstract_other: nnx.State,
    mesh: Mesh,
    eos_id: int | None,
    tokenizer_vocab_size: int | None = None,
  ):
    """tokenizer_vocab_size: the ids the reward functions' tokenizer can decode (a padded vocabulary's others are never sampled)."""
    self.graphdef = graphdef
    model = nnx.merge(graphdef, abstract_params, abstract_other)
    self.generator = Generator(
      model,
      SamplingParams.from_config(config),
      config=config,
      max_target_length=config.max_target_length,
      max_prefill_length=config.max_prefill_predict_length,
      eos_id=eos_id,
      mesh=mesh,
      tokenizer_vocab_size=tokenizer_vocab_size,
      fixed_bucket=True,  # one compile, made by the preflight checks; no recompilation mid-run
    )

  def compile(self, rows: int, adapters: bool) -> list[object]:
    """Compile prefill and the decode loop for `rows` prompt rows now; returns the two executables."""
    tokens, lengths = self.generator.pad([[0]] * rows)
    return list(self.generator._executables_for(tokens, lengths, np.zeros(tokens.shape[:1], np.int32) if adapters else None))

  def decode_state(self, params: nnx.State, other: nnx.State) -> nnx.State:
    """The generator's view of the parameters: the same arrays, arranged as one model state."""
    return nnx.split(nnx.merge(self.graphdef, params, other))[1]

  def sample(self, params: nnx.State, other: nnx.State, prompts: Sequence[Sequence[int]], key: jax.Array, adapter_ids: np.ndarray | None) -> list[list[int]]:
    """The completion of each prompt row (EOS included when emitted), sampled with `key`."""
    slots = None if adapter_ids is None else adapter_ids.tolist()
    return self.generator.generate(prompts, adapter_ids=slots, state=self.decode_state(params, other), key=key).tokens
