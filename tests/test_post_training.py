"""DPO and GRPO: the losses against hand computations (float32), preference pairs packed whole, GRPO rows and
advantages, the config's one-line errors. Runs on CPU in seconds; the learning figures are in benchmarks/post_training.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext.config import ConfigError
from maxtext.train import dpo, grpo
from maxtext.train import setup as setup_lib
from tests.test_data_common import sp_model, write_jsonl
from tests.test_train_helpers import mesh_for, tiny_config

ROOT = Path(__file__).resolve().parents[1]
GRPO_KEYS = dict(
  use_grpo=True,
  dataset_type="grain",
  train_data_columns=["prompt"],
  decode_sampling_strategy="weighted",
  grpo_reward_functions=["maxtext.train.rewards:contains_target"],
  max_prefill_predict_length=8,
  per_device_batch_size=2,
)
DPO_KEYS = dict(use_dpo=True, dataset_type="grain", train_data_columns=["chosen", "rejected"], dtype="float32", matmul_precision="highest")


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _hand_dpo(policy_logits, reference_logits, batch, beta, eps) -> dict[str, float]:
  """The DPO loss and rewards in float64 numpy, pair by pair (pair k of a row: segments 2k - 1 and 2k)."""
  t = np.asarray(batch["targets"])
  lp = np.take_along_axis(_log_softmax(np.asarray(policy_logits, np.float64)), t[..., None], -1)[..., 0]
  rp = np.take_along_axis(_log_softmax(np.asarray(reference_logits, np.float64)), t[..., None], -1)[..., 0]
  losses, r_w, r_l = [], [], []
  seg = np.asarray(batch["targets_segmentation"])
  for b in range(seg.shape[0]):
    for k in range(1, seg[b].max() // 2 + 1):
      c, r = seg[b] == 2 * k - 1, seg[b] == 2 * k
      rw, rl = beta * (lp[b, c].sum() - rp[b, c].sum()), beta * (lp[b, r].sum() - rp[b, r].sum())
      d = rw - rl
      losses.append(-(1 - eps) * np.log(1 / (1 + np.exp(-d))) - eps * np.log(1 / (1 + np.exp(d))))
      r_w.append(rw)
      r_l.append(rl)
  r_w, r_l = np.array(r_w), np.array(r_l)
  return {
    "loss": float(np.mean(losses)),
    "rewards/chosen": float(r_w.mean()),
    "rewards/rejected": float(r_l.mean()),
    "rewards/margin": float((r_w - r_l).mean()),
    "rewards/accuracy": float(np.mean(np.where(np.abs(r_w - r_l) < 1e-6, 0.5, r_w > r_l))),  # a float32 tie counts one half
    "pairs": len(losses),
  }


def _benchmark():
  """benchmarks/post_training.py as a module (its marker-pair task and configs)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("post_training_benchmark", ROOT / "benchmarks" / "post_training.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
  """The benchmark's marker-pair DPO task (tiny model, full finetuning), 4 steps: its setup, first batch and metrics."""
  from maxtext.train.loop import create_data_iterator, train

  bench = _benchmark()
  out = tmp_path_factory.mktemp("dpo")
  extra = ["eval_interval=-1", "dpo_beta=0.3", "dpo_label_smoothing=0.1", "device_peak_tflops=1", "learning_rate_schedule_steps=4"]
  config = bench.dpo_config(out, "ci", 4, False, [*extra, "enable_tensorboard=true"])
  setup = setup_lib.build(config, mesh_for(config))
  it = create_data_iterator(config, setup.mesh, "train")
  batch = next(it)
  it.close()
  straight = train(config, setup=setup).state["params"]
  resumable = [*extra, "enable_tensorboard=false", "enable_checkpointing=true", "async_checkpointing=false"]
  train(bench.dpo_config(out, "resumed", 2, False, resumable), setup=setup)
  resumed = train(bench.dpo_config(out, "resumed", 4, False, resumable), setup=setup).state["params"]
  return config, setup, batch, bench.read_metrics(config.metrics_file), _flat(straight), _flat(resumed)


def test_dpo_step_loss_equals_a_hand_computation(dpo_run):
  """The compiled train step on a batch of packed marker pairs, policy = initial parameters + noise, reference = the
  frozen initial copy in the state (counted in the step's memory): loss and rewards equal a float64 hand computation
  from the models' logits."""
  from maxtext.aot import memory

  config, setup, batch = dpo_run[:3]
  params_bytes = memory.state_bytes(setup.abstract_state["params"])
  assert memory.state_bytes(setup.abstract_state["reference"]) == params_bytes  # a full frozen copy, an argument of the step
  assert "reference" in setup.compiled_step.args_info[0][0]  # the memory checks (preflight, train_compile) count it
  with jax.set_mesh(setup.mesh):
    state = setup.init_state()
    initial = jax.tree.leaves(jax.tree.map(np.asarray, state["params"]))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(initial, jax.tree.leaves(state["reference"])))
    keys = iter(jax.random.split(jax.random.key(3), len(initial)))
    state["params"] = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(next(keys), p.shape, p.dtype), state["params"])
    other = state.get("other", nnx.State({}))
    logits = jax.jit(lambda params: nnx.merge(setup.graphdef, params, other)(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]))
    expected = _hand_dpo(logits(state["params"]), logits(state["reference"]), batch, config.dpo_beta, config.dpo_label_smoothing)
    _, metrics = setup.compiled_step(state, batch)
  m = {k: float(v) for k, v in metrics.items()}
  assert m["total_weights"] == expected.pop("pairs") > 8  # several pairs per row
  for key, value in expected.items():
    np.testing.assert_allclose(m[key], value, rtol=2e-5, atol=1e-6, err_msg=key)


def test_dpo_learns_the_marker_preference(dpo_run):
  """4 steps of the benchmark's task (40 in benchmarks/README.md): rewards/accuracy from about 0.5 to >= 0.95."""
  lines = dpo_run[3]
  assert [m["step"] for m in lines] == [0, 1, 2, 3]
  # policy = reference at the first step: every margin 0 up to rounding (the two forwards compile differently)
  assert lines[0]["rewards/accuracy"] == pytest.approx(0.5, abs=0.1) and lines[0]["loss"] == pytest.approx(np.log(2), rel=1e-4)
  assert lines[-1]["rewards/accuracy"] >= 0.95 and lines[-1]["rewards/margin"] > 0


def test_rewards_reach_the_step_line_tensorboard_and_the_plot(dpo_run, grpo_runs):
  """DPO's rewards and GRPO's reward, KL, clip fraction, completion length and time shares: in the step line, and
  (DPO, read back from the run's TensorBoard events) in the plot's panels."""
  from maxtext import plot
  from maxtext.train.metrics import format_line

  config, lines = dpo_run[0], dpo_run[3]
  events = plot.read_run(str(Path(config.base_output_directory) / config.run_name))
  assert all(sorted(events[k]) == [0, 1, 2, 3] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"))
  titles = [t for _, t in plot.panels_for([("dpo", events)])]
  assert "DPO reward accuracy" in titles and "DPO reward margin" in titles and "GRPO mean reward" not in titles
  line = format_line(3, lines[3])
  assert all(f"{k}: " in line for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")), line
  grpo_lines = grpo_runs[5]
  series = {k: {m["step"]: m[k] for m in grpo_lines} for k in grpo_lines[0] if k != "step"}
  assert [k for k, _ in plot.panels_for([("grpo", series)])][-2:] == ["reward", "kl"]
  line = format_line(1, grpo_lines[1])
  assert all(f"{k}: " in line for k in ("reward", "reward_std", "kl", "clip_fraction", "completion_length", "rollout_share", "update_share")), line


def test_dpo_resume_rebuilds_the_reference_and_is_bitwise(dpo_run):
  """2 steps, then the run resumed to 4 (its reference rebuilt from the seeded init, the checkpoint holds none) =
  4 steps uninterrupted, bitwise."""
  straight, resumed = dpo_run[4], dpo_run[5]
  assert straight.keys() == resumed.keys() and all(np.array_equal(straight[k], resumed[k]) for k in straight)


def test_lora_reference_is_the_base_model_with_adapters_off():
  """With LoRA the reference shares the base parameters: its logits equal those of the same model built without LoRA."""
  from maxtext.layers.lora import LoRAParam
  from maxtext.train import reference
  from maxtext.train.trainable import split_params

  lora = tiny_config(num_devices=1, lora={"enable_lora": True, "lora_rank": 2}, **DPO_KEYS)
  lora_setup, base_setup = (setup_lib.build(c, mesh_for(c)) for c in (lora, tiny_config(num_devices=1, **DPO_KEYS)))
  with jax.set_mesh(lora_setup.mesh):
    params = lora_setup.init_params()
  params = nnx.from_flat_state([(k, v.replace(v.get_value() + 0.1) if isinstance(v, LoRAParam) else v) for k, v in nnx.to_flat_state(params)])  # B != 0
  trainable, frozen = split_params(params, lora)
  assert not reference.stores_copy(lora, params)  # no second copy of anything
  tokens = jnp.asarray(np.arange(16).reshape(2, 8) % 100, jnp.int32)
  lora_logits = jax.jit(lambda t, f: nnx.merge(lora_setup.graphdef, t, f)(tokens))
  expected = jax.jit(lambda f: nnx.merge(base_setup.graphdef, f)(tokens))(frozen)  # the base model's own graph, LoRA's frozen weights
  np.testing.assert_array_equal(lora_logits(reference.reference_trainable(lora, {}, trainable), frozen), expected)
  assert not np.array_equal(lora_logits(trainable, frozen), expected)


def test_token_log_probs_with_vocab_tiling_equal_the_untiled_ones_and_their_gradient():
  from maxtext.layers.output_head import OutputHead

  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(8, 12)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 12, size=(2, 5)), jnp.int32)
  heads = [OutputHead(kernel, jnp.float32, jax.lax.Precision.HIGHEST, soft_cap=3.0, vocab_tiles=t) for t in (1, 4)]
  values = [jax.jit(h.token_log_probs, static_argnums=2)(hidden, targets, 0.7) for h in heads]
  hand = np.take_along_axis(_log_softmax(np.asarray(3.0 * np.tanh(np.asarray(hidden @ kernel) / 3.0) / 0.7, np.float64)), np.asarray(targets)[..., None], -1)
  np.testing.assert_allclose(values[0], hand[..., 0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(values[1], values[0], rtol=1e-5, atol=1e-6)
  grads = [
    jax.jit(jax.grad(lambda h, k, head=head: jnp.sum(dataclasses.replace(head, kernel=k).token_log_probs(h, targets)), argnums=(0, 1)))(hidden, kernel)
    for head in heads
  ]
  for a, b in zip(grads[0], grads[1]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _pair_sources(tmp_path: Path, rows: list[dict], jsonl: str) -> dict[str, dict]:
  """The same pairs as grain parquet and ArrayRecord files, a prepared tfds dataset and an HF json stream: config updates."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  import tensorflow_datasets as tfds
  from array_record.python.array_record_module import ArrayRecordWriter

  from maxtext.data.records import encode_tf_example

  pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), tmp_path / "pairs.parquet")
  writer = ArrayRecordWriter(str(tmp_path / "pairs.array_record"), "group_size:1")
  for r in rows:
    writer.write(encode_tf_example(r))
  writer.close()

  class MaxtextPairs(tfds.core.GeneratorBasedBuilder):
    __module__ = "maxtext_pairs"  # a top-level module name keeps tfds from looking for package resources
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      features = tfds.features.FeaturesDict({k: tfds.features.Text() for k in rows[0]})
      return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True)  # records in the order written

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      yield from enumerate(rows)

  MaxtextPairs(data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare()
  return {
    "parquet": {"grain_file_type": "parquet", "grain_train_files": str(tmp_path / "pairs.parquet")},
    "arrayrecord": {"grain_file_type": "arrayrecord", "grain_train_files": str(tmp_path / "pairs.array_record")},
    "tfds": {"dataset_type": "tfds", "dataset_name": "maxtext_pairs", "dataset_path": str(tmp_path / "tfds")},
    "hf": {"dataset_type": "hf", "hf_path": "json", "hf_train_files": jsonl},
  }


def test_pairs_are_packed_whole_with_responses_scored(tmp_path):
  """grain JSONL pairs through the real pipeline (parquet and ArrayRecord files, tfds and HF datasets give the same rows): both responses
  of a pair in one row (segments 2k - 1, 2k), positions restarting at each response, only response tokens (and EOS)
  scored; [chosen, rejected] without a prompt column scores the tokens after the longest common prefix."""
  from maxtext.data.pipeline import local_batches
  from maxtext.tokenizer import load_tokenizer

  rows = [{"prompt": f"question {i}", "chosen": " good" * (1 + i % 3), "rejected": " bad bad" * (1 + i % 2)} for i in range(24)]
  files = write_jsonl(tmp_path / "pairs.jsonl", rows)
  common = dict(
    dataset_type="grain",
    grain_file_type="jsonl",
    grain_train_files=files,
    tokenizer_type="sentencepiece",
    tokenizer_path=sp_model(),
    vocab_size=320,
    max_target_length=96,
    grain_worker_count=0,
    enable_data_shuffling=False,
    use_dpo=True,
  )
  tok = load_tokenizer("sentencepiece", sp_model())
  config = tiny_config(num_devices=1, per_device_batch_size=2, train_data_columns=["prompt", "chosen", "rejected"], **common)
  ds, _ = local_batches(config, "train", 0, 1, 2)
  batch = next(iter(ds))
  for kind, update in _pair_sources(tmp_path, rows, files).items():  # the same pairs from every kind of source
    other = next(iter(local_batches(config.model_copy(update=update), "train", 0, 1, 2)[0]))
    assert batch.keys() == other.keys() and all(np.array_equal(batch[k], other[k]) for k in batch), kind
  seg, tseg, pos = batch["inputs_segmentation"], batch["targets_segmentation"], batch["inputs_position"]
  for b in range(seg.shape[0]):
    ids = sorted(set(seg[b].tolist()) - {0})
    assert ids == list(range(1, len(ids) + 1)) and len(ids) % 2 == 0, ids  # whole pairs only
    for s in ids:
      idx = np.flatnonzero(seg[b] == s)
      assert np.array_equal(pos[b, idx], np.arange(len(idx)))
      scored = np.flatnonzero(tseg[b] == s)
      text = tok.decode(batch["targets"][b, scored].tolist())
      assert text.replace(" ", "") in ("good" * 3, "good" * 2, "good", "badbad", "badbad" * 2), text  # response tokens (EOS decodes to '')
      assert tok.eos_id in batch["targets"][b, scored].tolist()
  implicit = [{"chosen": f"the answer to {i} is yes", "rejected": f"the answer to {i} is no"} for i in range(16)]
  config = tiny_config(
    num_devices=1,
    per_device_batch_size=2,
    train_data_columns=["chosen", "rejected"],
    **{**common, "grain_train_files": write_jsonl(tmp_path / "implicit.jsonl", implicit)},
  )
  batch = next(iter(local_batches(config, "train", 0, 1, 2)[0]))
  for b in range(2):
    for s in sorted(set(batch["targets_segmentation"][b].tolist()) - {0}):
      scored = batch["targets"][b, batch["targets_segmentation"][b] == s].tolist()
      assert tok.decode(scored).strip() in ("yes", "no") and scored[-1] == tok.eos_id


def test_grpo_terms_and_advantages_equal_a_hand_computation():
  rng = np.random.default_rng(1)
  rewards = rng.normal(size=(3, 4))
  adv = grpo.group_advantages(rewards)
  hand = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)
  np.testing.assert_allclose(adv, hand, rtol=1e-6)
  assert np.all(grpo.group_advantages(np.ones((2, 3))) == 0)  # a group of equal rewards teaches nothing

  b, s, eps, beta = 4, 6, 0.2, 0.05
  lp = rng.normal(-2.0, 0.5, size=(b, s))
  old = lp + rng.normal(0.0, 0.3, size=(b, s))  # ratios spread beyond 1 +- eps
  ref = lp + rng.normal(0.0, 0.2, size=(b, s))
  a = np.array([1.5, -0.7, 0.3, -2.0])
  mask = rng.random((b, s)) < 0.7
  terms = jax.jit(grpo.grpo_terms, static_argnums=(5, 6))
  out = {k: float(v) for k, v in terms(*(jnp.asarray(x, jnp.float32) for x in (lp, old, ref, a)), jnp.asarray(mask), eps, beta).items()}
  ratio = np.exp(lp - old)
  obj = np.minimum(ratio * a[:, None], np.clip(ratio, 1 - eps, 1 + eps) * a[:, None])
  kl = np.exp(ref - lp) - (ref - lp) - 1
  clipped = ((ratio < 1 - eps) & (a[:, None] < 0)) | ((ratio > 1 + eps) & (a[:, None] > 0))
  np.testing.assert_allclose(out["loss"], np.sum(-(obj - beta * kl) * mask), rtol=1e-5)
  np.testing.assert_allclose(out["kl"], np.sum(kl * mask), rtol=1e-5)
  assert out["clipped"] == np.sum(clipped * mask) > 0 and out["tokens"] == mask.sum()

  # the gradient: with old = policy (rho = 1) it is -A d log pi + beta d kl, token by token
  def loss(x):
    return grpo.grpo_terms(x, jax.lax.stop_gradient(x), jnp.asarray(ref, jnp.float32), jnp.asarray(a, jnp.float32), jnp.asarray(mask), eps, beta)["loss"]

  grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(lp, jnp.float32)))
  np.testing.assert_allclose(grad, (-a[:, None] + beta * (1 - np.exp(ref - lp))) * mask, rtol=1e-4, atol=1e-6)


def test_rollout_rows_score_the_completion_tokens():
  rows = grpo.rollout_rows([np.array([5, 6, 7]), np.array([9])], [[11, 12, 2], [13]], 8)
  assert rows["inputs"].tolist() == [[5, 6, 7, 11, 12, 2, 0, 0], [9, 13, 0, 0, 0, 0, 0, 0]]
  assert rows["targets"].tolist() == [[6, 7, 11, 12, 2, 0, 0, 0], [13, 0, 0, 0, 0, 0, 0, 0]]
  assert rows["targets_segmentation"].tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
  assert rows["inputs_position"][0].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]


def test_config_errors_are_one_line():
  tiny_config(num_devices=1, **GRPO_KEYS)
  cases = [
    (dict(use_dpo=True, **GRPO_KEYS), "use_dpo and use_grpo are both true"),
    (dict(use_dpo=True, dataset_type="grain", train_data_columns=["text"]), "[chosen, rejected]"),
    (dict(use_dpo=True, dataset_type="synthetic"), "use_dpo reads preference pairs"),
    (dict(use_dpo=True, dataset_type="grain", train_data_columns=["a", "b"], use_truncation=False), "use_truncation=true"),
    ({**GRPO_KEYS, "num_generations": 1}, "num_generations=1"),
    ({**GRPO_KEYS, "decode_sampling_strategy": "greedy"}, "greedy"),
    ({**GRPO_KEYS, "grpo_reward_functions": []}, "grpo_reward_functions"),
    ({**GRPO_KEYS, "grpo_reward_weights": [1.0, 2.0]}, "grpo_reward_weights"),
    ({**GRPO_KEYS, "num_generations": 3}, "multiple of num_generations"),
    ({**GRPO_KEYS, "z_loss_multiplier": 1e-4}, "z_loss_multiplier"),
  ]
  for overrides, mention in cases:
    with pytest.raises(ConfigError) as e:
      tiny_config(num_devices=1, **overrides)
    assert mention in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))


def test_reward_functions_load_and_fail_with_one_line_naming_function_and_row():
  from maxtext.errors import DataError
  from maxtext.train import rewards

  with pytest.raises(ConfigError, match="module 'no_such_module' does not import"):
    rewards.load(["no_such_module:fn"])
  with pytest.raises(ConfigError, match="has no function 'nope'"):
    rewards.load(["maxtext.train.rewards:nope"])
  with pytest.raises(ConfigError, match="is not 'module:function'"):
    rewards.load(["maxtext.train.rewards"])
  (r,) = rewards.load(["maxtext.train.rewards:contains_target"], [2.0])
  assert r.weight == 2.0 and r.short_name == "contains_target"
  where = ["data.jsonl line 1", "data.jsonl line 2"]
  assert rewards.score(r, ["p", "p"], ["a cat", "a dog"], {"target": ["cat", "cat"]}, where).tolist() == [1.0, 0.0]
  picky = rewards.Reward("m:picky", lambda prompts, completions, **_: [1.0 / (len(c) - 5) for c in completions], 1.0)
  with pytest.raises(DataError) as e:  # divides by zero on the second row's completion only
    rewards.score(picky, ["p", "p"], ["a cat!", "a dog"], {}, where)
  assert "'m:picky' raised ZeroDivisionError" in str(e.value) and "line 2" in str(e.value) and "\n" not in str(e.value)
  nan = rewards.Reward("m:nan_reward", lambda prompts, completions, **_: [0.0, float("nan")], 1.0)
  with pytest.raises(DataError, match=r"'m:nan_reward' returned nan for data.jsonl line 2"):
    rewards.score(nan, ["p", "p"], ["a", "b"], {}, where)


def _prompt_data(files: str) -> dict:
  """Prompts from JSONL files, read in order by the main process, tokenized by the tiny sentencepiece model."""
  return dict(
    grain_file_type="jsonl",
    grain_train_files=files,
    tokenizer_type="sentencepiece",
    tokenizer_path=sp_model(),
    vocab_size=320,
    enable_data_shuffling=False,
    grain_worker_count=0,
  )


def test_prompt_records_carry_their_columns(tmp_path):
  from maxtext.data.prompt_iterator import create_prompt_iterator

  rows = [{"prompt": f"say {i}", "target": str(i), "extra": i} for i in range(8)]
  config = tiny_config(
    num_devices=1, **_prompt_data(write_jsonl(tmp_path / "p.jsonl", rows)), **{**GRPO_KEYS, "max_prefill_predict_length": 4, "per_device_batch_size": 4}
  )
  it = create_prompt_iterator(config, mesh_for(config), "train", 0, 1)
  first = next(it)
  assert len(first) == 2 and [p["fields"]["target"] for p in first] == ["0", "1"] and first[0]["fields"]["extra"] == 0
  assert len(first[0]["tokens"]) <= 4 and "line 1" in first[0]["where"]
  state = it.get_state()
  second = next(it)
  it.set_state(state)
  assert [p["text"] for p in next(it)] == [p["text"] for p in second]
  it.close()


def test_pair_data_without_its_columns_is_one_line(tmp_path):
  from maxtext.data.pipeline import local_batches
  from maxtext.errors import DataError

  config = tiny_config(
    num_devices=1,
    dataset_type="grain",
    grain_file_type="jsonl",
    grain_train_files=write_jsonl(tmp_path / "p.jsonl", [{"chosen": "a b"}] * 4),
    tokenizer_type="sentencepiece",
    tokenizer_path=sp_model(),
    vocab_size=320,
    use_dpo=True,
    train_data_columns=["chosen", "rejected"],
    grain_worker_count=0,
  )
  with pytest.raises(DataError, match="no column 'rejected'") as e:
    next(iter(local_batches(config, "train", 0, 1, 1)[0]))
  assert "\n" not in str(e.value)


def test_dpo_pair_metrics_ignore_padding_and_lonely_segments():
  seg = jnp.asarray([[1, 1, 2, 2, 3, 3, 0, 0]])  # segment 3 has no rejected partner
  assert dpo.pair_mask(seg).tolist() == [[1.0, 0.0, 0.0, 0.0]]
  terms = jax.jit(dpo.dpo_terms, static_argnums=(3, 4))(jnp.zeros((1, 8)), jnp.zeros((1, 8)), seg, 0.1, 0.0)  # policy = reference: every pair a tie
  assert float(terms["pairs"]) == 1 and float(terms["correct"]) == 0.5 and float(terms["loss"]) == pytest.approx(np.log(2))


def reward_a(prompts, completions, adapter, **_):
  """Adapter a's task: completions with many letters 'a' (other adapters' rows score 0)."""
  return [c.count("a") / max(len(c), 1) if ad == "a" else 0.0 for c, ad in zip(completions, adapter)]


def reward_b(prompts, completions, adapter, **_):
  """Adapter b's task: completions with many letters 'b'."""
  return [c.count("b") / max(len(c), 1) if ad == "b" else 0.0 for c, ad in zip(completions, adapter)]


TWO_ADAPTERS = {"enable_lora": True, "lora_rank": 2, "max_lora_adapters": 2, "lora_adapters": ["a", "b"], "adapter_column": "adapter"}


def _grpo_config(out, run: str, steps: int, **extra):
  """Tiny GRPO on two adapters: prompts alternate two of adapter a, two of adapter b; a step holds two prompts."""
  rows = [{"prompt": p, "adapter": ad} for p, ad in [("x y", "a"), ("x z", "a"), ("y y", "b"), ("z z", "b")]] * 4
  keys = dict(
    grpo_reward_functions=["tests.test_post_training:reward_a", "tests.test_post_training:reward_b"],
    per_device_batch_size=4,
    num_generations=2,
    num_iterations=2,
    steps=steps,
    learning_rate_schedule_steps=2,
    base_output_directory=str(out),
    run_name=run,
    lora=TWO_ADAPTERS,
  )
  return tiny_config(num_devices=1, **{**_prompt_data(write_jsonl(out / "prompts.jsonl", rows)), **GRPO_KEYS, **keys, **extra})


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
  """One step (adapter a's prompts), the same run resumed for a second (adapter b's), and two steps uninterrupted
  in another run directory; all three share one compiled setup (train step, rollout decoder, scoring forward)."""
  from maxtext.train.loop import train

  out = tmp_path_factory.mktemp("grpo")
  config = _grpo_config(out, "straight", 2, metrics_file=str(out / "metrics.jsonl"), enable_checkpointing=False)
  setup = setup_lib.build(config, mesh_for(config))
  with jax.set_mesh(setup.mesh):
    initial = _flat(setup.init_state()["params"])  # the compiled init the runs use, not a second one
  first = train(_grpo_config(out, "resumed", 1), setup=setup).state
  resumed = train(_grpo_config(out, "resumed", 2), setup=setup).state
  straight = train(config, setup=setup).state
  lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return config, initial, _flat(first["params"]), _flat(resumed["params"]), _flat(straight["params"]), lines, setup


def _flat(params) -> dict[str, np.ndarray]:
  return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def _slot(value: np.ndarray, config, slot: int) -> np.ndarray:
  from maxtext.config.adapters import slot_axis

  return np.take(value, slot, axis=slot_axis(config))


def test_grpo_trains_only_the_adapters_of_its_prompts_and_never_the_base(grpo_runs):
  config, initial, first, resumed = grpo_runs[:4]
  adapters = [k for k in initial if k.endswith(("lora_a", "lora_b"))]
  assert adapters and all(np.array_equal(first[k], initial[k]) and np.array_equal(resumed[k], initial[k]) for k in initial if k not in adapters)
  b_untouched = all(np.array_equal(_slot(first[k], config, 1), _slot(initial[k], config, 1)) for k in adapters)
  a_kept = all(np.array_equal(_slot(resumed[k], config, 0), _slot(first[k], config, 0)) for k in adapters)
  assert b_untouched and a_kept  # step 0 holds only adapter a's prompts, step 1 only adapter b's
  assert any(not np.array_equal(_slot(first[k], config, 0), _slot(initial[k], config, 0)) for k in adapters)
  assert any(not np.array_equal(_slot(resumed[k], config, 1), _slot(initial[k], config, 1)) for k in adapters)


def test_grpo_resume_is_bitwise_and_reports_its_metrics(grpo_runs):
  """Preempted after a step and resumed (sampling key and prompt iterator from the checkpoint) = uninterrupted."""
  resumed, straight, lines = grpo_runs[3:6]
  assert resumed.keys() == straight.keys() and all(np.array_equal(resumed[k], straight[k]) for k in straight)
  assert [m["step"] for m in lines] == [0, 1]
  for key in ("reward", "reward/reward_a/mean", "reward/reward_b/std", "kl", "clip_fraction", "completion_length", "rollout_share", "update_share"):
    assert all(np.isfinite(m[key]) for m in lines), key
  assert lines[0]["reward/reward_b/mean"] == 0 and lines[1]["reward/reward_a/mean"] == 0  # each step scores its own adapter's task
  assert abs(sum(lines[0][f"{k}_share"] for k in ("rollout", "scoring", "update")) - 1) < 1e-6


def test_grpo_ends_normally_when_its_prompts_are_used_up(grpo_runs, tmp_path):
  """4 prompts, 2 per step, num_epoch=1: two steps, then a normal end ('data_used_up') with the last step saved."""
  from maxtext.train.loop import train

  rows = [{"prompt": p, "adapter": ad} for p, ad in [("x y", "a"), ("x z", "a"), ("y y", "b"), ("z z", "b")]]
  config = _grpo_config(tmp_path, "short", 5, grain_train_files=write_jsonl(tmp_path / "four.jsonl", rows), async_checkpointing=False)
  result = train(config, setup=grpo_runs[6])
  assert (result.stop_reason, result.steps_done) == ("data_used_up", 2)
  assert (tmp_path / "short" / "checkpoints" / "2").is_dir()


def test_grpo_updates_reuse_the_rollouts_old_log_probabilities(grpo_runs):
  """num_iterations=2 on one rollout batch: the compiled step reads pi_old from the batch (scored once, by the
  scoring forward at the rollout's parameters) for both updates. Scored at the step's parameters, the first
  update's ratio is 1 (nothing clips) and the second's is against the rollout, which the first update moved away
  from (had pi_old been rescored per update, nothing would clip). Old log-probabilities one nat higher make the
  first update's ratio e^-1 < 1 - epsilon: exactly the tokens with a negative advantage clip there."""
  config, setup = grpo_runs[0], grpo_runs[6]
  rows = grpo.rollout_rows([np.array([5, 6, 7])] * 4, [[8, 9, 10, 11], [8, 12], [13, 14, 15], [9, 9, 9, 9, 2]], config.max_target_length)
  rows["advantages"] = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
  rows["adapter_ids"] = np.where(rows["inputs_segmentation"] > 0, 0, -1).astype(np.int32)
  batch = {k: jax.device_put(v, setup.batch_shardings[k]) for k, v in rows.items() if k in setup.abstract_batch}
  negative_share = float(np.sum(rows["targets_segmentation"][1::2]) / np.sum(rows["targets_segmentation"]))
  with jax.set_mesh(setup.mesh):
    state = setup.init_state()
    scored = setup.score_fn(state["params"], state.get("other", nnx.State({})), state.get("reference", nnx.State({})), batch)
    assert np.allclose(np.asarray(scored[grpo.OLD_KEY]), np.asarray(scored[grpo.REFERENCE_KEY]))  # policy = reference at init
    _, same = setup.compiled_step(state, {**batch, **scored})
    shifted = {**scored, grpo.OLD_KEY: scored[grpo.OLD_KEY] + 1.0}
    _, high = setup.compiled_step(setup.init_state(), {**batch, **shifted})
    # optimizer_memory_host_offload: the two updates' loop carries the state on the device; it returns to the host
    offloaded = setup_lib.build(config.model_copy(update={"optimizer_memory_host_offload": True}), setup.mesh)
    new_state, on_host = offloaded.compiled_step(offloaded.init_state(), {**batch, **scored})
  assert {x.sharding.memory_kind for x in jax.tree.leaves(new_state["opt_state"])} == {"pinned_host"}
  np.testing.assert_allclose(float(on_host["loss"]), float(same["loss"]), rtol=1e-6)
  same, high = float(same["clip_fraction"]), float(high["clip_fraction"])  # means over the two updates
  assert 0 < same <= 0.5 and high >= 0.5 * negative_share - 1e-6 and high != same


def test_step_flops_count_the_reference_and_scoring_forwards():
  from maxtext import counting

  plain = tiny_config(num_devices=1)
  train, forward = counting.training_flops_per_step(plain), counting.forward_flops_per_step(plain)
  assert forward * 3 == pytest.approx(train)  # full finetuning: 2 of the 6 FLOPs per parameter, 1 of the 3 attention passes
  assert counting.step_flops(tiny_config(num_devices=1, **DPO_KEYS)) == pytest.approx(train + forward)
  grpo3 = tiny_config(num_devices=1, num_iterations=3, **GRPO_KEYS)  # + old and reference log-probabilities
  assert counting.step_flops(grpo3) == pytest.approx(3 * counting.training_flops_per_step(grpo3) + 2 * counting.forward_flops_per_step(grpo3))
  no_kl = tiny_config(num_devices=1, grpo_beta=0.0, **GRPO_KEYS)  # one update, no scoring forward
  assert counting.step_flops(no_kl) == pytest.approx(counting.training_flops_per_step(no_kl)) == pytest.approx(2 * train)
