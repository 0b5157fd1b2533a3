"""Post-training learning checks and the GRPO step's time split: `python benchmarks/post_training.py <task> [options]`.

Each task trains with `maxtext.train.loop.train` exactly as `python -m maxtext.train` does, reads the run's metrics
file and prints one JSON line.

  dpo [--lora]      synthetic preference pairs (chosen responses end in the marker word 'alpha', rejected ones in
                    'omega', same words otherwise) on a tiny model from scratch, --steps (40): rewards/accuracy at
                    the first step and over the last five, and on held-out pairs after training.
  grpo --base DIR   GRPO on the quickstart model (DIR: its checkpoints, e.g. maxtext_output/quickstart/checkpoints),
                    --steps (50), prompts of the embedded corpus, reward 1 when the completion contains --target:
                    mean reward over the first and last five steps, and the step's time split (rollout, scoring,
                    update) over the steps after the first.
  adapters --base DIR  two LoRA adapters on the quickstart model, each prompt routed to one (alternating), two reward
                    functions (adapter a: contains --target; adapter b: contains --target_b): each adapter's reward
                    at the start and the end, and whether the base weights are bitwise unchanged.

Options: --out DIR (default /tmp/maxtext_post_training), --steps N, key=value overrides for the run's config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORDS = "red green blue cat dog bird sun moon tree river stone cloud fire wind rain snow leaf seed road hill".split()


def marker_pairs(count: int, seed: int) -> list[dict[str, str]]:
  """Preference pairs whose chosen response ends in 'alpha' and rejected response in 'omega'; prompt and response
  words are random and shared by both responses."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    prompt = " ".join(rng.choice(WORDS, 4))
    body = " ".join(rng.choice(WORDS, 3))
    rows.append({"prompt": prompt, "chosen": f" {body} alpha", "rejected": f" {body} omega"})
  return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def marker_tokenizer(out: Path) -> str:
  from maxtext.tokenizer import train_sentencepiece

  path = out / "markers_sp.model"
  if not path.exists():
    texts = [" ".join(r.values()) for r in marker_pairs(400, 99)]
    train_sentencepiece(texts, 320, str(path))
  return str(path)


def dpo_config(out: Path, run: str, steps: int, lora: bool, extra: list[str]):
  """A tiny llama2 model on the marker pairs (train: 2000 pairs, eval: 200 others)."""
  from maxtext.config import load
  from maxtext.process import prepare

  train_files = write_jsonl(out / "markers_train.jsonl", marker_pairs(2000, 0))
  eval_files = write_jsonl(out / "markers_eval.jsonl", marker_pairs(200, 1))
  keys = dict(
    run_name=run,
    base_output_directory=str(out),
    base_emb_dim=64,
    base_num_query_heads=4,
    base_num_kv_heads=4,
    head_dim=16,
    base_mlp_dim=128,
    base_num_decoder_layers=2,
    vocab_size=320,
    dtype="float32",
    max_target_length=96,
    per_device_batch_size=8,
    dataset_type="grain",
    grain_file_type="jsonl",
    grain_train_files=train_files,
    grain_eval_files=eval_files,
    tokenizer_type="sentencepiece",
    tokenizer_path=marker_tokenizer(out),
    use_dpo="true",
    train_data_columns="[prompt,chosen,rejected]",
    steps=steps,
    learning_rate=1e-2 if lora else 1e-3,
    warmup_steps_fraction=0.0,
    eval_interval=steps,
    eval_steps=4,
    grain_worker_count=0,
    enable_checkpointing="false",
    metrics_file=str(out / run / "metrics.jsonl"),
  )
  if lora:
    keys.update({"lora.enable_lora": "true", "lora.lora_rank": 8, "lora.lora_alpha": 16})
  keys.update(e.split("=", 1) for e in extra)  # key=value arguments override the task's values
  return load([str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())], devices=prepare)


def read_metrics(path: str | Path) -> list[dict]:
  return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_dpo(args: argparse.Namespace, extra: list[str]) -> dict:
  from maxtext.train.loop import train

  run = f"dpo_{'lora' if args.lora else 'full'}"
  config = dpo_config(Path(args.out), run, args.steps, args.lora, extra)
  if os.path.exists(config.metrics_file):
    os.remove(config.metrics_file)
  train(config)
  lines = read_metrics(config.metrics_file)
  steps = [m for m in lines if "rewards/accuracy" in m]
  evals = [m for m in lines if "eval_rewards/accuracy" in m]
  return {
    "task": run,
    "steps": len(steps),
    "accuracy_first_step": steps[0]["rewards/accuracy"],
    "accuracy_last_5_steps": float(np.mean([m["rewards/accuracy"] for m in steps[-5:]])),
    "first_step_at_0.95": next((m["step"] for m in steps if m["rewards/accuracy"] >= 0.95), None),
    "margin_last_step": steps[-1]["rewards/margin"],
    "eval_accuracy_after": evals[-1]["eval_rewards/accuracy"] if evals else None,
  }


def grpo_config(out: Path, run: str, args: argparse.Namespace, extra: list[str], adapters: bool = False):
  """The quickstart model from args.base, GRPO on the embedded corpus's prompts with a target-word reward."""
  from maxtext.config import load
  from maxtext.process import prepare

  prompts = [{**r, "target": args.target, "target_b": args.target_b, "adapter": "ab"[i % 2]} for i, r in enumerate(embedded_prompts())]
  keys = {
    "run_name": run,
    "base_output_directory": str(out),
    "load_parameters_path": args.base,
    "tokenizer_path": quickstart_tokenizer(args.base),
    "dataset_type": "grain",
    "grain_file_type": "jsonl",
    "grain_train_files": write_jsonl(out / "prompts.jsonl", prompts),
    "use_grpo": "true",
    "train_data_columns": "[prompt]",
    "grpo_reward_functions": "[maxtext.train.rewards:contains_target]",
    "decode_sampling_strategy": "weighted",
    "num_generations": 8,
    "per_device_batch_size": 64,
    "max_prefill_predict_length": 16,
    "max_target_length": 48,
    "learning_rate": 2e-4,
    "warmup_steps_fraction": 0.0,
    "steps": args.steps,
    "eval_interval": -1,
    "enable_checkpointing": "false",
    "metrics_file": str(out / run / "metrics.jsonl"),
  }
  if adapters:
    keys.update(
      {
        "grpo_reward_functions": "[" + ",".join(f"benchmarks.post_training:{f}" for f in ("target_for_a", "target_for_b", "other_for_a", "other_for_b")) + "]",
        "grpo_reward_weights": "[1,1,0,0]",  # the last two only watch: each adapter's rate of the other adapter's target
        "lora.enable_lora": "true",
        "lora.max_lora_adapters": 2,
        "lora.lora_adapters": "[a,b]",
        "lora.adapter_column": "adapter",
        "lora.lora_rank": 8,
        "learning_rate": 2e-3,
      }
    )
  keys.update(e.split("=", 1) for e in extra)  # key=value arguments override the task's values
  return load([str(REPO / "configs" / "quickstart.yml"), *(f"{k}={v}" for k, v in keys.items())], devices=prepare)


def quickstart_tokenizer(base: str) -> str:
  """The tokenizer the quickstart run trained with: <base_output_directory>/tokenizers/, above its checkpoints."""
  for parent in Path(base).resolve().parents:
    candidate = parent / "tokenizers" / "pydoc_topics_sp4096.model"
    if candidate.is_file():
      return str(candidate)
  raise SystemExit(f"no tokenizers/pydoc_topics_sp4096.model above {base}; pass --base <base_output_directory>/quickstart/checkpoints")


def embedded_prompts() -> list[dict]:
  from maxtext.data import embedded

  return [{"prompt": r["prompt"], "text": r["text"]} for _, r in embedded.documents("train")]


def target_for_a(prompts, completions, adapter, target, **_):
  """Adapter a's task: the completion contains the row's `target` (rows of adapter b score 0)."""
  return [float(ad == "a" and t in c) for c, ad, t in zip(completions, adapter, target)]


def target_for_b(prompts, completions, adapter, target_b, **_):
  """Adapter b's task: the completion contains the row's `target_b`."""
  return [float(ad == "b" and t in c) for c, ad, t in zip(completions, adapter, target_b)]


def other_for_a(prompts, completions, adapter, target_b, **_):
  """Watch only (weight 0): adapter a's completions that contain adapter b's target."""
  return [float(ad == "a" and t in c) for c, ad, t in zip(completions, adapter, target_b)]


def other_for_b(prompts, completions, adapter, target, **_):
  """Watch only (weight 0): adapter b's completions that contain adapter a's target."""
  return [float(ad == "b" and t in c) for c, ad, t in zip(completions, adapter, target)]


def _window(lines: list[dict], key: str, first: bool) -> float:
  values = [m[key] for m in lines if key in m]
  return float(np.mean(values[:5] if first else values[-5:]))


def run_grpo(args: argparse.Namespace, extra: list[str]) -> dict:
  from maxtext.train.loop import train

  config = grpo_config(Path(args.out), "grpo_toy", args, extra)
  if os.path.exists(config.metrics_file):
    os.remove(config.metrics_file)
  train(config)
  lines = read_metrics(config.metrics_file)
  timed = lines[1:]  # the first step compiles nothing new (the preflight did) but warms caches
  start, end = _window(lines, "reward", True), _window(lines, "reward", False)
  return {
    "task": "grpo_toy",
    "steps": len(lines),
    "target": args.target,
    "reward_first_step": lines[0]["reward"],
    "reward_first_5": start,
    "reward_last_5": end,
    "ratio": end / start if start > 0 else None,
    "kl_last": lines[-1]["kl"],
    "completion_length_last_5": _window(lines, "completion_length", False),
    **{f"{k}_share": float(np.mean([m[f"{k}_share"] for m in timed])) for k in ("rollout", "scoring", "update")},
    **{f"{k}_seconds": float(np.mean([m[f"{k}_seconds"] for m in timed])) for k in ("rollout", "scoring", "update")},
  }


def run_adapters(args: argparse.Namespace, extra: list[str]) -> dict:
  import jax
  from flax import nnx

  from maxtext.layers.lora import LoRAParam
  from maxtext.train import checkpoint_files
  from maxtext.train.loop import train

  config = grpo_config(Path(args.out), "grpo_adapters", args, extra, adapters=True)
  if os.path.exists(config.metrics_file):
    os.remove(config.metrics_file)
  result = train(config)
  lines = read_metrics(config.metrics_file)
  base_now = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.filter_state(result.state["params"], nnx.Not(LoRAParam)))}
  abstract = nnx.filter_state(result.state["params"], nnx.Not(LoRAParam))
  loaded = checkpoint_files.restore_some_params(args.base, jax.tree.map(_abstract, abstract), "base")[0]
  base_then = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(loaded)}
  return {
    "task": "grpo_adapters",
    "steps": len(lines),
    # each function scores half of the rows (its adapter's): x2 is the rate on that adapter's completions
    **{f"adapter_{s}_own_target_first_5": _window(lines, f"reward/target_for_{s}/mean", True) * 2 for s in "ab"},
    **{f"adapter_{s}_own_target_last_5": _window(lines, f"reward/target_for_{s}/mean", False) * 2 for s in "ab"},
    **{f"adapter_{s}_other_target_first_5": _window(lines, f"reward/other_for_{s}/mean", True) * 2 for s in "ab"},
    **{f"adapter_{s}_other_target_last_5": _window(lines, f"reward/other_for_{s}/mean", False) * 2 for s in "ab"},
    "base_bitwise_unchanged": base_now.keys() == base_then.keys() and all(np.array_equal(base_now[k], base_then[k]) for k in base_now),
  }


def _abstract(x):
  import jax

  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("task", choices=["dpo", "grpo", "adapters"])
  parser.add_argument("--lora", action="store_true")
  parser.add_argument("--steps", type=int, default=0)
  parser.add_argument("--base", default="maxtext_output/quickstart/checkpoints")
  parser.add_argument("--target", default="value")
  parser.add_argument("--target_b", default="object")
  parser.add_argument("--out", default="/tmp/maxtext_post_training")
  args, extra = parser.parse_known_args(argv)
  args.steps = args.steps or (40 if args.task == "dpo" else 50)
  args.base = os.path.abspath(args.base)
  sys.path.insert(0, str(REPO))
  out = {"dpo": run_dpo, "grpo": run_grpo, "adapters": run_adapters}[args.task](args, extra)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
