"""Padded vocabularies and GRPO reward functions.

A model whose vocab_size exceeds its tokenizer's (as most checkpoints pad it) never samples an id the tokenizer
cannot decode, under every strategy: the sampler itself, `python -m maxtext.decode` and `maxtext.generate` on a
model whose padding ids would otherwise win. GRPO rollouts take the same path (tests/test_bad_inputs_rewards.py
trains a step on a padded vocabulary). Reward functions run in a worker process: a nested list, strings, sys.exit,
memory beyond grpo_reward_memory_gib, a hang or the worker's death are each one line naming the function; a
function that mutates its arguments changes nothing of the trainer's; statistics of huge finite rewards stay finite.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext.errors import ConfigError, DataError
from maxtext.inference.sampling import SamplingParams, sample
from maxtext.train import grpo, rewards
from maxtext.train.reward_worker import Interrupted, RewardWorker
from tests.test_data_common import sp_model

STRATEGIES = {
  "greedy": SamplingParams("greedy"),
  "weighted": SamplingParams("weighted"),
  "topk": SamplingParams("topk", top_k=5),
  "nucleus": SamplingParams("nucleus", nucleus_p=0.9),
}
VOCAB, REAL = 512, 320  # the model's vocab_size; the sentencepiece model's pieces


def test_no_strategy_samples_a_padding_id():
  """Logits whose padding ids are the most likely: 256 draws per strategy stay below the tokenizer's size (and
  without it most draws are padding ids); greedy takes the best real id."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(np.concatenate([rng.normal(size=(2, REAL)), 8 + rng.normal(size=(2, VOCAB - REAL))], axis=1), jnp.float32)
  keys = jax.random.split(jax.random.key(0), 256)
  for name, params in STRATEGIES.items():
    masked = jax.vmap(lambda k, p=params: sample(logits, k, p, REAL))(keys)
    unmasked = jax.vmap(lambda k, p=params: sample(logits, k, p))(keys)
    assert int(masked.max()) < REAL, name
    assert float(jnp.mean(unmasked >= REAL)) > 0.9, name
  assert sample(logits, keys[0], STRATEGIES["greedy"], REAL).tolist() == np.argmax(np.asarray(logits)[:, :REAL], axis=1).tolist()


def _padded_hf_model(path: Path) -> Path:
  """A one-layer Llama directory with vocab_size 512 whose padding ids (320 and up) have by far the largest logits."""
  from safetensors.numpy import save_file

  rng = np.random.default_rng(1)
  e, heads, head_dim, mlp = 16, 2, 8, 32
  cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=e, intermediate_size=mlp, num_attention_heads=heads)
  cfg.update(num_key_value_heads=heads, num_hidden_layers=1, vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64)
  cfg.update(tie_word_embeddings=False, hidden_act="silu", head_dim=head_dim)
  path.mkdir(exist_ok=True)
  (path / "config.json").write_text(json.dumps(cfg))

  def small(*shape):
    return (0.02 * rng.normal(size=shape)).astype(np.float32)

  embed = small(VOCAB, e)
  embed[:, 0] = 1.0  # every hidden state points along dimension 0 ...
  head = 0.1 * rng.normal(size=(VOCAB, e)).astype(np.float32)
  head[:, 0] = 0.0
  head[REAL:, 0] = 2.0  # ... which only the padding ids' output rows read
  q = heads * head_dim
  t = {"model.embed_tokens.weight": embed, "model.norm.weight": np.ones(e, np.float32), "lm_head.weight": head}
  for name, shape in {"q_proj": (q, e), "k_proj": (q, e), "v_proj": (q, e), "o_proj": (e, q)}.items():
    t[f"model.layers.0.self_attn.{name}.weight"] = small(*shape)
  for name, shape in {"gate_proj": (mlp, e), "up_proj": (mlp, e), "down_proj": (e, mlp)}.items():
    t[f"model.layers.0.mlp.{name}.weight"] = small(*shape)
  t["model.layers.0.input_layernorm.weight"] = np.ones(e, np.float32)
  t["model.layers.0.post_attention_layernorm.weight"] = np.ones(e, np.float32)
  save_file(t, str(path / "model.safetensors"))
  return path


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
  return _padded_hf_model(tmp_path_factory.mktemp("padded_llama"))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_decode_command_with_a_padded_vocabulary(padded_model, strategy, capsys):
  from maxtext.decode import main

  params = STRATEGIES[strategy]
  main(
    [
      "configs/base.yml",
      f"hf_model_path={padded_model}",
      f"tokenizer_path={sp_model()}",
      "tokenizer_type=sentencepiece",
      "prompt=the quick fox",
      "max_target_length=24",
      "max_prefill_predict_length=16",
      "dtype=float32",
      f"decode_sampling_strategy={strategy}",
      f"decode_sampling_top_k={params.top_k}",
      f"decode_sampling_nucleus_p={params.nucleus_p}",
    ]
  )
  out = capsys.readouterr().out
  assert "completion: " in out and "decode: " in out


def test_generate_with_a_padded_vocabulary_emits_only_tokenizer_ids(padded_model):
  import maxtext
  from maxtext.inference import Generator
  from maxtext.tokenizer import load_tokenizer

  tokenizer = load_tokenizer("sentencepiece", sp_model())
  assert tokenizer.vocab_size == REAL
  model, config = maxtext.from_hf(padded_model, dtype="float32", max_target_length=24, max_prefill_predict_length=16)
  texts = maxtext.generate(model, tokenizer, ["the quick fox", "a"], config=config, sampling=STRATEGIES["topk"])
  assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
  gen = Generator(model, STRATEGIES["weighted"], config=config, max_target_length=24, max_prefill_length=16, tokenizer_vocab_size=REAL)
  tokens = gen.generate([tokenizer.encode("the quick fox")] * 4, seed=3).tokens
  assert sum(map(len, tokens)) > 40 and max(max(t) for t in tokens) < REAL  # 4 rows of up to 21 tokens, none a padding id
  with pytest.raises(ConfigError, match="tokenizer_vocab_size=513"):
    Generator(model, config=config, tokenizer_vocab_size=VOCAB + 1)


# --- reward functions -------------------------------------------------------------------------------------------

HOOKS = """
import os
import sys
import time


def length(prompts, completions, **_):
  return [float(len(c)) for c in completions]


def nested(prompts, completions, **_):
  return [[1.0, 2.0], [3.0, 4.0]]


def numeric_strings(prompts, completions, **_):
  return ["1.0"] * len(completions)


def exits(prompts, completions, **_):
  sys.exit()


def mutates(prompts, completions, target, **_):
  scores = [float(t == "cat") for t in target]
  completions.clear()
  target[0] = "dog"
  prompts.append("extra")
  return scores


def hog(prompts, completions, **_):
  blob = bytearray(2**31)
  return [float(len(blob))] * len(completions)


def dies(prompts, completions, **_):
  os._exit(3)


def hangs(prompts, completions, **_):
  while True:
    time.sleep(1)
"""
ARGS = (["p", "p", "q", "q"], ["a", "bb", "ccc", "dddd"], {"target": ["cat", "cat", "dog", "dog"]}, [f"data.jsonl line {i // 2 + 1}" for i in range(4)])


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
  """One worker process for every hook below (timeout 3 s, 0.5 GiB), importing them from a directory on sys.path."""
  hooks = tmp_path_factory.mktemp("hooks")
  (hooks / "padded_vocab_reward_hooks.py").write_text(HOOKS)
  with pytest.MonkeyPatch.context() as mp:
    mp.syspath_prepend(str(hooks))
    names = ["length", "nested", "numeric_strings", "exits", "mutates", "hog", "dies", "hangs"]
    w = RewardWorker([f"padded_vocab_reward_hooks:{n}" for n in names], timeout_s=3, memory_gib=0.5)
  yield w, {n: i for i, n in enumerate(names)}
  w.close()


def _fails(worker, name: str) -> str:
  w, index = worker
  with pytest.raises(DataError) as e:
    w.score(index[name], *ARGS)
  message = str(e.value)
  assert f"reward function 'padded_vocab_reward_hooks:{name}'" in message and "\n" not in message, message
  return message


def test_reward_results_of_the_wrong_kind_are_one_line_naming_the_function(worker):
  w, index = worker
  assert w.score(index["length"], *ARGS).tolist() == [1.0, 2.0, 3.0, 4.0]
  assert "returned [[1.0, 2.0], [3.0, 4.0]], values of shape (2, 2), not a flat list" in _fails(worker, "nested")
  assert "'1.0' is a str, not a number" in _fails(worker, "numeric_strings")
  assert "called sys.exit(None)" in _fails(worker, "exits")
  assert "ran out of memory (grpo_reward_memory_gib=0.5)" in _fails(worker, "hog")
  assert w.alive  # each of these leaves the worker serving


def test_a_reward_mutating_its_arguments_changes_nothing_of_the_trainers(worker):
  w, index = worker
  prompts, completions, columns, where = (list(a) if isinstance(a, list) else {k: list(v) for k, v in a.items()} for a in ARGS)
  assert w.score(index["mutates"], prompts, completions, columns, where).tolist() == [1.0, 1.0, 0.0, 0.0]
  assert (prompts, completions, columns, where) == ARGS
  r = rewards.Reward("m:mutates", lambda p, c, target, **_: (c.clear(), target.clear(), [1.0] * 4)[-1], 1.0)  # the same in-process
  assert rewards.score(r, prompts, completions, columns, where).tolist() == [1.0] * 4 and (prompts, completions, columns, where) == ARGS


def test_a_reward_that_ends_its_worker_or_hangs_is_one_line_and_a_signal_interrupts_it(tmp_path, monkeypatch):
  (tmp_path / "padded_vocab_reward_hooks.py").write_text(HOOKS)
  monkeypatch.syspath_prepend(str(tmp_path))
  entries = ["padded_vocab_reward_hooks:dies", "padded_vocab_reward_hooks:hangs"]
  w = RewardWorker(entries, timeout_s=1, memory_gib=1)
  with pytest.raises(DataError, match=r"'padded_vocab_reward_hooks:dies' ended the reward worker process \(exit code 3\)"):
    w.score(0, *ARGS)
  w = RewardWorker(entries, timeout_s=1, memory_gib=1)
  with pytest.raises(DataError, match=r"'padded_vocab_reward_hooks:hangs' did not return within grpo_reward_timeout_s=1 seconds"):
    w.score(1, *ARGS)
  assert not w.alive
  w = RewardWorker(entries, timeout_s=600, memory_gib=1)
  began = time.monotonic()
  with pytest.raises(Interrupted):
    w.score(1, *ARGS, interrupted=lambda: time.monotonic() - began > 0.5)
  assert not w.alive and time.monotonic() - began < 5
  with pytest.raises(ConfigError, match="module 'padded_vocab_reward_hooks' has no function 'nope'"):
    RewardWorker(["padded_vocab_reward_hooks:nope"], timeout_s=10, memory_gib=1)


def test_huge_finite_rewards_keep_finite_statistics_and_their_advantages():
  """+-1e300 in a group: advantages +-1 (they used to become 0 when the std overflowed to inf); equal rewards 0."""
  adv = grpo.group_advantages(np.array([[1e300, -1e300], [1e308, 1e308], [3.0, 1.0]]))
  np.testing.assert_allclose(adv, [[1, -1], [0, 0], [1, -1]], atol=1e-4)
  mean, std = rewards.mean_and_std(np.array([1e300, -1e300, 1e300, -1e300]))
  assert mean == 0 and std == pytest.approx(1e300)
  with pytest.raises(DataError, match="returned inf for data.jsonl line 1"):
    rewards.as_scores("m:f", [float("inf"), 0, 0, 0], 4, ARGS[3])
