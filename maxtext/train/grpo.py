"""Group relative policy optimisation (Shao et al. 2024, DeepSeekMath) on the train loop.

One train step (`Trainer.step`):
  1. rollout: each prompt of the step is sampled num_generations times by the compiled KV-cache decoder on the
     train state's current parameters (maxtext.inference.rollout: no copy, no second model), with the
     decode_sampling_* keys and the key fold_in(key(decode_sampling_seed), step);
  2. scoring: the reward functions (maxtext.train.rewards) score each completion; r = sum_f w_f r_f; the
     advantage of completion i of a group is A_i = (r_i - mean r) / (std r + 1e-4) (population std of the group);
     then one forward pass gives the reference's log-probabilities (grpo_beta > 0) and, with num_iterations > 1,
     the current policy's ("old") log-probabilities;
  3. update: num_iterations optimizer updates on the rollout batch, each minimising, over completion tokens t,

         rho_t = exp(log pi(t) - log pi_old(t)),   kl_t = exp(ref_t - log pi(t)) - (ref_t - log pi(t)) - 1
         loss = sum_t -(min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A) - beta kl_t) / completion tokens of the batch

     (token-level normalisation, as MaxText's loss_algo=grpo). With num_iterations = 1, pi_old is the policy
     itself without gradient (rho = 1).
Log-probabilities are of softmax(logits / decode_sampling_temperature), the distribution the rollout samples from
(top-k and nucleus truncation aside).

Rows: one completion per row, prompt then completion, unpacked; targets_segmentation marks the completion tokens
(EOS included when sampled). With lora.max_lora_adapters > 1 and lora.adapter_column, each prompt's adapter slot
samples its completions and is the only adapter its rows train; slots with no row in the batch are untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxtext import memory_limit
from maxtext.aot import memory
from maxtext.config import MaxTextConfig
from maxtext.data.features import NO_ADAPTER
from maxtext.errors import ConfigError, DataError
from maxtext.train import reference as reference_lib
from maxtext.train import reward_worker
from maxtext.train import rewards as rewards_lib
from maxtext.train.loss import token_log_probs
from maxtext.train.objective import SummedTerms
from maxtext.train.trainable import split_params

ADVANTAGE_EPS = 1e-4
OLD_KEY, REFERENCE_KEY = "old_log_probs", "reference_log_probs"
Batch = dict[str, jax.Array]


def group_advantages(rewards: np.ndarray) -> np.ndarray:
  """rewards [prompts, num_generations] -> (r - group mean) / (group population std + ADVANTAGE_EPS), float32.

  Computed on each group's rewards divided by their largest magnitude s, as (z - mean z) / (std z + ADVANTAGE_EPS / s):
  the same value, without overflow for any finite rewards (+-1e300 give advantages +-1, not 0)."""
  rewards = np.asarray(rewards, np.float64)
  scale = np.max(np.abs(rewards), axis=1, keepdims=True)
  scale = np.where(scale > 0, scale, 1.0)
  scaled = rewards / scale
  centred = scaled - scaled.mean(axis=1, keepdims=True)
  spread = scaled.std(axis=1, keepdims=True) + ADVANTAGE_EPS / scale
  return np.divide(centred, spread, out=np.zeros_like(centred), where=spread > 0).astype(np.float32)


def grpo_terms(
  log_probs: jax.Array,
  old_log_probs: jax.Array,
  reference_log_probs: jax.Array | None,
  advantages: jax.Array,
  mask: jax.Array,
  epsilon: float,
  beta: float,
) -> dict[str, jax.Array]:
  """Sums over completion tokens (mask [B, S]) of the GRPO loss, the KL and the clipped tokens, from per-token
  log-probabilities [B, S] and per-row advantages [B]."""
  mask = mask.astype(jnp.float32)
  a = advantages[:, None]
  ratio = jnp.exp(log_probs - old_log_probs)
  objective = jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon) * a)
  clipped = ((ratio < 1.0 - epsilon) & (a < 0)) | ((ratio > 1.0 + epsilon) & (a > 0))
  if reference_log_probs is None:
    kl = jnp.zeros_like(log_probs)
  else:
    d = reference_log_probs - log_probs
    kl = jnp.exp(d) - d - 1.0
  return {
    "loss": jnp.sum(-(objective - beta * kl) * mask),
    "kl": jnp.sum(kl * mask),
    "clipped": jnp.sum(clipped * mask),
    "tokens": jnp.sum(mask),
  }


class GRPO(SummedTerms):
  """The GRPO update objective (see the module docstring); its batch carries advantages and scored log-probabilities."""

  TERMS = ("loss", "kl", "clipped", "tokens")
  uses_reference = False  # reference log-probabilities come with the batch, scored once per rollout batch

  def __init__(self, config: MaxTextConfig):
    super().__init__(config)
    self.iterations = config.num_iterations
    self.extra_batch: dict[str, tuple[bool, Any]] = {"advantages": (False, jnp.float32)}
    if config.num_iterations > 1:
      self.extra_batch[OLD_KEY] = (True, jnp.float32)
    if config.grpo_beta > 0:
      self.extra_batch[REFERENCE_KEY] = (True, jnp.float32)

  def weight(self, batch: Batch) -> jax.Array:
    return jnp.maximum(jnp.sum(batch["targets_segmentation"] != 0).astype(jnp.float32), 1.0)

  def sums(self, policy: Any, reference: Any, batch: Batch, training: bool) -> dict[str, jax.Array]:
    c = self.config
    log_probs, stats = token_log_probs(policy, batch, c.decode_sampling_temperature)
    old = batch[OLD_KEY] if OLD_KEY in batch else jax.lax.stop_gradient(log_probs)
    terms = grpo_terms(log_probs, old, batch.get(REFERENCE_KEY), batch["advantages"], batch["targets_segmentation"] != 0, c.grpo_epsilon, c.grpo_beta)
    return self.with_moe(terms, stats)

  def metrics(self, sums: dict[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
    return {"kl": sums["kl"] / weight, "clip_fraction": sums["clipped"] / weight, "moe_lb_loss": self.mean_aux(sums), "total_weights": sums["tokens"]}

  def combine_eval(self, sums: list[dict[str, Any]]) -> dict[str, float]:
    raise ConfigError("use_grpo has no eval split loss (its rows are sampled); set eval_interval=-1")


def rollout_rows(prompts: list[np.ndarray], completions: list[list[int]], length: int) -> dict[str, np.ndarray]:
  """One row per completion: prompt + completion, right-padded to length; targets_segmentation is 1 where the
  target is a completion token."""
  b = len(prompts)
  inputs = np.zeros((b, length), np.int32)
  targets = np.zeros((b, length), np.int32)
  segment = np.zeros((b, length), np.int32)
  scored = np.zeros((b, length), np.int32)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    seq = np.concatenate([np.asarray(p, np.int32), np.asarray(c, np.int32)])[:length]
    n = len(seq)
    inputs[i, :n] = seq
    targets[i, : n - 1] = seq[1:]
    segment[i, :n] = 1
    scored[i, len(p) - 1 : n - 1] = 1
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)) * segment
  return {
    "inputs": inputs,
    "inputs_position": positions,
    "inputs_segmentation": segment,
    "targets": targets,
    "targets_position": positions,
    "targets_segmentation": scored,
  }


def make_score_fn(config: MaxTextConfig, setup: Any) -> Callable | None:
  """jit (params, other, reference, batch) -> {old_log_probs, reference_log_probs} as the objective needs them; None if neither."""
  keys = [k for k in (OLD_KEY, REFERENCE_KEY) if k in setup.objective.extra_batch]
  if not keys:
    return None
  graphdef, temperature = setup.graphdef, config.decode_sampling_temperature

  def score(params: nnx.State, other: nnx.State, reference: nnx.State, batch: Batch) -> dict[str, jax.Array]:
    out = {}
    if OLD_KEY in keys:
      out[OLD_KEY] = token_log_probs(nnx.merge(graphdef, params, other), batch, temperature)[0]
    if REFERENCE_KEY in keys:
      trainable, frozen = split_params(params, config)
      ref_trainable = reference_lib.reference_trainable(config, {reference_lib.KEY: reference}, trainable)
      out[REFERENCE_KEY] = token_log_probs(nnx.merge(graphdef, ref_trainable, frozen, other), batch, temperature)[0]
    return out

  shardings = setup.state_shardings
  batch_in = {k: v for k, v in setup.batch_shardings.items() if k not in keys}
  in_shardings = (shardings["params"], shardings.get("other", nnx.State({})), shardings.get(reference_lib.KEY, nnx.State({})), batch_in)
  return jax.jit(score, in_shardings=in_shardings, out_shardings={k: setup.batch_shardings[k] for k in keys})


class Trainer:
  """Runs GRPO steps: rollout, scoring and update, with their wall-time split in the step's metrics."""

  def __init__(self, config: MaxTextConfig, setup: Any, step_fn: Any, data_iter: Any):
    from maxtext.data.pipeline import resolve_tokenizer

    self.config, self.setup, self.step_fn, self.data_iter = config, setup, step_fn, data_iter
    self.reward_names = rewards_lib.short_names(config.grpo_reward_functions)
    self.reward_weights = [float(w) for w in config.grpo_reward_weights] or [1.0] * len(self.reward_names)
    self.rewards = reward_worker.shared(config.grpo_reward_functions, config.grpo_reward_timeout_s, config.grpo_reward_memory_gib)
    self.tokenizer = resolve_tokenizer(config)
    self.eos_id = self.tokenizer.eos_id
    self.rollout, self.score_fn = setup.rollout, setup.score_fn  # compiled once per setup
    self.multi_adapter = config.lora.enable_lora and config.lora.max_lora_adapters > 1
    self.base_key = jax.random.key(config.decode_sampling_seed)

  def step(self, state: dict[str, Any], step: int, interrupted: Callable[[], bool] = reward_worker.never) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """One GRPO step on the next prompts; returns the updated state (ready) and the step's metrics, or None when
    num_epoch passes over the prompts are used up or interrupted() turned true while a reward function ran (the
    step is dropped and its prompts are put back: a resumed run takes them again)."""
    c, g = self.config, self.config.num_generations
    position = self.data_iter.get_state()
    prompts = next(self.data_iter, None)
    if prompts is None:
      return None
    began = time.perf_counter()
    rows = [p for p in prompts for _ in range(g)]  # prompt-major: prompt i's group is rows i*g .. i*g + g - 1
    tokens = [p["tokens"] for p in rows]
    adapters = np.asarray([p["adapter"] for p in rows], np.int32) if self.multi_adapter else None
    other = state.get("other", nnx.State({}))
    completions = self.rollout.sample(state["params"], other, [t.tolist() for t in tokens], jax.random.fold_in(self.base_key, step), adapters)
    sampled = time.perf_counter()

    texts = [self.tokenizer.decode([t for t in comp if t != self.eos_id]) for comp in completions]
    columns = {k: [p["fields"].get(k) for p in rows] for k in dict.fromkeys(k for p in prompts for k in p["fields"])}
    where = [p["where"] for p in rows]
    try:
      scores = {name: self.rewards.score(i, [p["text"] for p in rows], texts, columns, where, interrupted) for i, name in enumerate(self.reward_names)}
    except reward_worker.Interrupted:
      self.data_iter.set_state(position)
      return None
    total = self._total(scores, where)
    local = rollout_rows(tokens, completions, c.max_target_length)
    local["advantages"] = group_advantages(total.reshape(-1, g)).reshape(-1)
    if self.multi_adapter:
      local["adapter_ids"] = np.where(local["inputs_segmentation"] > 0, adapters[:, None], NO_ADAPTER).astype(np.int32)
    batch = self._global(local)
    if self.score_fn is not None:
      batch.update(self.score_fn(state["params"], other, state.get(reference_lib.KEY, nnx.State({})), batch))
    jax.block_until_ready(batch)
    scored = time.perf_counter()

    state, metrics = self.step_fn(state, batch)
    jax.block_until_ready(state)
    updated = time.perf_counter()
    seconds = {"rollout": sampled - began, "scoring": scored - sampled, "update": updated - scored}
    total_seconds = max(updated - began, 1e-9)
    stats = {name: rewards_lib.mean_and_std(v) for name, v in {"": total, **scores}.items()}  # no overflow for huge finite rewards
    host = {
      "reward": float(stats[""][0]),
      "reward_std": float(stats[""][1]),
      **{f"reward/{name}/mean": float(stats[name][0]) for name in scores},
      **{f"reward/{name}/std": float(stats[name][1]) for name in scores},
      "completion_length": float(np.mean([len(comp) for comp in completions])),
      **{f"{k}_seconds": v for k, v in seconds.items()},
      **{f"{k}_share": v / total_seconds for k, v in seconds.items()},
    }
    return state, {**metrics, **host}

  def _total(self, scores: dict[str, np.ndarray], where: list[str]) -> np.ndarray:
    """sum_f w_f r_f per completion; a total beyond float64's range is a DataError."""
    with np.errstate(over="ignore", invalid="ignore"):
      total = sum(w * scores[name] for name, w in zip(self.reward_names, self.reward_weights))
    bad = np.flatnonzero(~np.isfinite(total))
    if bad.size:
      i = int(bad[0])
      raise DataError(
        f"the weighted reward total of {where[i]} (completion {i}) overflows a float64 ({', '.join(f'{n}: {scores[n][i]:g}' for n in self.reward_names)}); "
        "scale the rewards or grpo_reward_weights down"
      )
    return total

  def _global(self, local: dict[str, np.ndarray]) -> Batch:
    """This process's rows -> global arrays in the train step's batch shardings."""
    out = {}
    for key, value in local.items():
      abstract = self.setup.abstract_batch[key]
      out[key] = jax.make_array_from_process_local_data(self.setup.batch_shardings[key], value, abstract.shape)
    return out


def prepare(config: MaxTextConfig, setup: Any, step_fn: Any, data_iter: Any) -> Trainer:
  """The GRPO trainer of a run, built by the preflight checks: reward functions imported (a bad path is a
  ConfigError), the tokenizer loaded, the rollout decoder ready."""
  if jax.process_count() > 1:
    raise ConfigError("use_grpo runs in a single process for now (rollouts and rewards are host-local); run it on one host")
  trainer = Trainer(config, setup, step_fn, data_iter)
  check_rollout_fit(config, setup, trainer.multi_adapter)
  return trainer


def check_rollout_fit(config: MaxTextConfig, setup: Any, adapters: bool) -> None:
  """Compile the rollout decoder for the step's rows and check that it fits beside the rest of the train state
  (optimizer state and reference stay resident while it runs)."""
  executables = setup.rollout.compile(config.global_batch_size_to_train_on, adapters)
  sizes = [memory.step_bytes(e) for e in executables]
  if any(s is None for s in sizes):
    return
  params = memory.state_bytes(setup.abstract_state["params"]) // config.num_devices
  resident = memory.state_bytes(setup.abstract_state) // config.num_devices - params  # beside the decoder's own arguments (params, cache)
  need = max(s[0] for s in sizes) + resident
  limit = memory_limit.limit_per_device()
  if need > memory.MEMORY_HEADROOM * limit.bytes:
    raise ConfigError(
      f"the GRPO rollout needs about {need / 2**30:.2f} GiB per device (KV cache for {config.global_batch_size_to_train_on} rows of "
      f"{config.max_target_length} tokens, beside the optimizer state) but {limit.what} leaves {limit.bytes / 2**30:.2f} GiB per device; "
      "lower per_device_batch_size or max_target_length, or shard over more devices"
    )
