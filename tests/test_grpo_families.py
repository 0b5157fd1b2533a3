"""GRPO on every decoder family: one step (rollout, scoring, update) of a tiny bfloat16 model per family, and its
rollout replayed against the teacher-forced forward.

The replay: each rollout token is the sampler's draw (jax.random.categorical: argmax of logits + Gumbel noise, the
noise from the step's key) from the logits the KV-cache decoder computed. Drawn again from the teacher-forced forward's
logits at the same position with the same noise, it must be the same token, up to bfloat16 rounding between the two
forms: a decode state that disagrees with the parallel form (a linear-attention state, a ring buffer, a shared or
sparse cache) draws from other logits. Runs on CPU in bfloat16, where XLA:CPU's bf16 dots are exercised (a dense MoE
decode once crashed there: tests/test_grpo_families.py::test_bf16_dense_moe_decodes).
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.convert import hf_config
from maxtext.inference.sampling import SamplingParams, allowed_logits, mask_padding, sample
from maxtext.train import setup as setup_lib
from tests.test_data_common import write_jsonl
from tests.test_pipeline_hybrid import TINY_QWEN3_NEXT
from tests.test_post_training import GRPO_KEYS, _flat, _prompt_data
from tests.test_train_helpers import mesh_for, tiny_config


def _from_hf(module: str, *args) -> dict:
  """A family's tiny Hugging Face config (its own test module's) as maxtext overrides."""
  import importlib

  return hf_config.overrides_from_hf(importlib.import_module(f"tests.{module}").tiny_config(*args).to_dict())


FAMILIES = {
  "qwen3_next": lambda: dict(TINY_QWEN3_NEXT, base_num_decoder_layers=4),  # Gated DeltaNet decode state, dense MoE
  "qwen3_5": lambda: _from_hf("test_qwen3_5", "dense"),
  "qwen3_5_moe": lambda: _from_hf("test_qwen3_5", "moe"),
  "llama4": lambda: _from_hf("test_llama4"),  # chunked attention on the rope layers, NoPE layers, interleaved MoE
  # per-layer inputs (a row for each of the tokenizer's 320 ids), sliding windows, the last layers' KV shared, tied embeddings
  "gemma4": lambda: dict(_from_hf("test_gemma4"), vocab_size_per_layer_input=0),
  "olmo3": lambda: dict(decoder_block="olmo3"),
  "qwen2": lambda: dict(decoder_block="qwen2"),
  "deepseek_v32": lambda: _from_hf("test_deepseek_v32"),  # MLA over the indexer's top-k keys
  "mixtral": lambda: dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=16),  # dense MoE dispatch
}
PROMPTS = [{"prompt": p, "target": "a"} for p in ("x y", "x z", "y y", "z z")]
MARGIN = 0.25  # logit units: bf16 rounding between the decode and the parallel form may swap draws this close


def _config(tmp_path, family: str):
  overrides = {
    **FAMILIES[family](),
    **_prompt_data(write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)),
    **GRPO_KEYS,
    "dtype": "bfloat16",
    "per_device_batch_size": 4,  # 2 prompts x 2 generations
    "num_generations": 2,
    "max_target_length": 16,
    "steps": 1,
    "base_output_directory": str(tmp_path),
    "run_name": family,
    "metrics_file": str(tmp_path / "metrics.jsonl"),
    "enable_checkpointing": False,
  }
  return tiny_config(num_devices=1, **overrides)


def _teacher_forced_logits(setup, state, prompts: list[list[int]], completions: list[list[int]], length: int) -> np.ndarray:
  """The model's forward over prompt + completion (one row each, right-padded): float32 logits [B, length, V]."""
  b = len(prompts)
  tokens = np.zeros((b, length), np.int32)
  segments = np.zeros((b, length), np.int32)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    seq = (p + c)[:length]
    tokens[i, : len(seq)] = seq
    segments[i, : len(seq)] = 1
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)) * segments
  graphdef = setup.graphdef

  @jax.jit
  def forward(params, other, tokens, positions, segments):
    return nnx.merge(graphdef, params, other)(tokens, positions, segments).astype(jnp.float32)

  with jax.set_mesh(setup.mesh):
    return np.asarray(forward(state["params"], state.get("other", nnx.State({})), tokens, positions, segments))


def _replay(logits: np.ndarray, prompts, completions, key, sampling: SamplingParams, vocab: int) -> tuple[int, int, float]:
  """Draw each completion token again from the teacher-forced logits with the decode loop's noise (step j of the loop
  samples every row's token j with fold_in(key, j)) -> (tokens compared, tokens equal, the largest margin by which a
  differing rollout token lost the replayed draw)."""
  rows = len(prompts)
  compared = equal = 0
  worst = 0.0
  for j in range(max(len(c) for c in completions)):
    at = np.array([min(len(p) + j - 1, logits.shape[1] - 1) for p in prompts])
    step_logits = jnp.asarray(logits[np.arange(rows), at])  # [B, V]: row b's logits for its token j
    k = jax.random.fold_in(key, j)
    perturbed = np.asarray(allowed_logits(mask_padding(step_logits, vocab), sampling) + jax.random.gumbel(k, step_logits.shape))
    drawn = np.asarray(sample(step_logits, k, sampling, vocab))
    assert np.array_equal(drawn, perturbed.argmax(-1)), "the replayed noise is not the sampler's (jax.random.categorical changed?)"
    for b, c in enumerate(completions):
      if j < len(c) and len(prompts[b]) + j < logits.shape[1]:
        compared += 1
        equal += int(c[j] == drawn[b])
        worst = max(worst, float(perturbed[b, drawn[b]] - perturbed[b, c[j]]))
  return compared, equal, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_step_and_rollout_agree_with_the_forward(family, tmp_path):
  from maxtext.train.loop import train

  config = _config(tmp_path, family)
  setup = setup_lib.build(config, mesh_for(config))
  with jax.set_mesh(setup.mesh):
    state = setup.init_state()
  initial = _flat(state["params"])

  # the rollout decoder on the initial parameters, replayed against the teacher-forced forward
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
  key = jax.random.key(3)
  other = state.get("other", nnx.State({}))
  completions = setup.rollout.sample(state["params"], other, prompts, key, None)
  assert all(completions) and all(len(p) + len(c) <= config.max_target_length for p, c in zip(prompts, completions))
  logits = _teacher_forced_logits(setup, state, prompts, completions, config.max_target_length)
  sampling = setup.rollout.generator.sampling
  compared, equal, worst = _replay(logits, prompts, completions, key, sampling, setup.rollout.generator.tokenizer_vocab_size)
  assert compared >= 12 and equal >= 0.9 * compared and worst <= MARGIN, (family, compared, equal, worst)

  # one GRPO step: rollout, reward, scoring, update
  result = train(config, setup=setup)
  (metrics,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  for k in ("reward", "kl", "loss", "grad_norm", "completion_length"):
    assert math.isfinite(metrics[k]), (family, k, metrics[k])
  assert abs(metrics["kl"]) < 1e-3 and metrics["completion_length"] > 0  # policy = reference at step 0
  after = _flat(result.state["params"])
  assert any(not np.array_equal(initial[k], after[k]) for k in initial), family


def test_bf16_dense_moe_decodes():
  """A bf16 Mixtral-shaped model decodes on CPU: its dense MoE dispatch once handed XLA:CPU a bf16 expert product
  that neither its bf16 kernels nor its fallback run ('Unsupported element type for DotThunk')."""
  from maxtext import platform
  from maxtext.config import from_overrides
  from maxtext.inference.generate import Generator
  from tests.test_decode import perturbed
  from tests.test_train_helpers import TINY_MODEL

  keys = dict(FAMILIES["mixtral"](), base_num_decoder_layers=1, max_target_length=12, max_prefill_predict_length=8)
  config = from_overrides(num_devices=1, **{**TINY_MODEL, **keys})
  assert config.dtype == "bfloat16" and platform.moe_dispatch(config, "cpu") == "dense"
  tokens = Generator(perturbed(config), config=config).generate([[1, 2, 3], [4, 5]]).tokens
  assert [len(t) for t in tokens] == [9, 10]
