"""`python -m maxtext.eval <config.yml> load_parameters_path=... key=value ...`: loss and perplexity without training.

The parameters come from hf_model_path (a Hugging Face directory, read as load_parameters_path is), load_parameters_path
(an Orbax checkpoint or a Hugging Face directory), load_full_state_path, or the run's own latest checkpoint
(<base_output_directory>/<run_name>/checkpoints/); the batches from the eval split of the training data pipeline
(eval_steps batches, or the whole split with eval_steps=-1 or 0), scored by the training loop's eval step.

An eval that does not fit the device memory is refused before anything is read (exit 2, as a training run's checks
do); an out-of-memory error that still happens is one `error: out of memory in the eval ...` line, exit 1.
With eval_harness_tasks set, it runs those lm-evaluation-harness tasks on the model instead (decode's model sources,
hf_model_path included) and prints each task's metrics.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

from maxtext.cli import config_usage, entry
from maxtext.errors import ConfigError

USAGE = config_usage(
  "maxtext.eval",
  "Evaluate a checkpoint without training: print the eval loss and perplexity over eval_steps batches of the\n"
  "eval split (eval_steps=-1 or 0: the whole split), read by the same data pipeline and scored by the same eval step\n"
  "as training. Parameters: hf_model_path, load_parameters_path, load_full_state_path, or the latest checkpoint\n"
  "of run_name. eval_harness_tasks=[task,...] (with eval_harness_include_path=DIR for local task files) runs\n"
  "lm-evaluation-harness tasks on the model instead (docs/evaluation.md).",
  "python -m maxtext.eval configs/quickstart.yml eval_steps=5",
)


def evaluate(config: Any, log: Callable[[str], None] = print, mesh: Any = None) -> dict[str, float]:
  """{'eval_loss', 'eval_total_weights', 'perplexity', 'seconds'} of the config's parameters on its eval split (mesh: default all devices)."""
  import jax
  from etils import epath

  from maxtext import memory_limit
  from maxtext import mesh as mesh_lib
  from maxtext.train import checkpointing, loop, preflight
  from maxtext.train import setup as setup_lib

  if config.eval_steps <= 0 and config.dataset_type == "synthetic":
    raise ConfigError(f"eval_steps={config.eval_steps} evaluates the whole eval split, but synthetic data never ends; set eval_steps to a positive number")
  if config.use_grpo:
    raise ConfigError("use_grpo has no eval loss (its rows are sampled); score a GRPO model with maxtext.decode and your reward functions")
  own = epath.Path(config.checkpoint_dir)
  has_own = config.enable_checkpointing and own.exists() and any(p.name.isdigit() for p in own.iterdir())
  if not (has_own or config.load_parameters_path or config.load_full_state_path):
    raise ConfigError(f"nothing to evaluate: no checkpoint in {config.checkpoint_dir} and no load_parameters_path or load_full_state_path; set one of them")
  mesh = mesh if mesh is not None else mesh_lib.create(config)
  setup = setup_lib.build(config, mesh)
  preflight.check_eval_memory_fit(config, setup)  # before any array is read
  ckpt = checkpointing.Checkpointer(config) if has_own else None
  try:
    with jax.set_mesh(mesh), memory_limit.one_line("in the eval", preflight.eval_memory_remedy(config)):
      state = loop.restore_or_init(setup, ckpt, None, log)  # eval reads its own split from the start
      began = time.perf_counter()
      result = loop._evaluate(config, setup, state)
  finally:
    if ckpt is not None:
      ckpt.close()
  return {**result, "perplexity": math.exp(min(result["eval_loss"], 700.0)), "seconds": time.perf_counter() - began}


def harness(config: Any, argv: list[str]) -> dict[str, Any]:
  """simple_evaluate's results for config.eval_harness_tasks on the model decode would load (argv: the command's
  arguments, for hf_model_path's architecture), global_batch_size_to_eval_on requests per forward pass; an unknown
  task is a ConfigError before the model is loaded."""
  from maxtext.integrations import require_lm_eval

  require_lm_eval()
  from lm_eval import simple_evaluate

  from maxtext.integrations.lm_eval_backend import MaxTextLM, load, task_manager, unknown_tasks

  unknown_tasks(config.eval_harness_tasks, config.eval_harness_include_path)
  tasks = task_manager(config.eval_harness_include_path or None)
  model, model_config, tokenizer, mesh = load(argv)
  return simple_evaluate(
    model=MaxTextLM(model, tokenizer, maxtext_config=model_config, batch_size=config.global_batch_size_to_eval_on, mesh=mesh),
    tasks=list(config.eval_harness_tasks),
    task_manager=tasks,
  )


def with_hf_model(argv: list[str], config: Any) -> list[str]:
  """argv with hf_model_path's Hugging Face directory as load_parameters_path (its config.json sets the architecture,
  its tokenizer the tokenizer); argv unchanged without hf_model_path."""
  from maxtext.convert.hf_dir import is_hf_dir
  from maxtext.errors import ConfigError

  path = config.hf_model_path
  if not path:
    return argv
  if not is_hf_dir(path):
    raise ConfigError(f"hf_model_path '{path}' is not a Hugging Face model directory (config.json + *.safetensors); point it at one")
  if config.load_parameters_path or config.load_full_state_path:
    raise ConfigError("hf_model_path and load_parameters_path/load_full_state_path both name the parameters to evaluate; set only one")
  return [*argv, f"load_parameters_path={path}"]


@entry(USAGE)
def main(argv: list[str]) -> None:
  from maxtext.config import load
  from maxtext.process import prepare

  first = load(argv)  # no devices started: only hf_model_path and eval_harness_tasks are read
  if not first.eval_harness_tasks:  # the harness loads hf_model_path as decode does
    argv = with_hf_model(argv, first)
  config = load(argv, devices=prepare)
  if config.eval_harness_tasks:
    from maxtext.integrations.lm_eval_backend import results_lines

    for line in results_lines(harness(config, argv)):
      print(line)
    return
  r = evaluate(config)
  batches = f"{config.eval_steps} batches" if config.eval_steps > 0 else "the whole eval split"
  scores = (  # DPO reports its rewards on held-out pairs; a perplexity of the DPO loss would mean nothing
    f"rewards/accuracy: {r['eval_rewards/accuracy']:.3f}, rewards/margin: {r['eval_rewards/margin']:.4f}"
    if config.use_dpo
    else f"perplexity: {r['perplexity']:.2f}"
  )
  print(f"eval over {batches}: eval_loss: {r['eval_loss']:.4f}, {scores}, total_weights: {int(r['eval_total_weights'])}, seconds: {r['seconds']:.1f}")


if __name__ == "__main__":
  main(sys.argv[1:])
