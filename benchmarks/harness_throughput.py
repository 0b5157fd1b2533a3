"""Log-likelihood requests per second: the lm-evaluation-harness backend `maxtext` against the harness's `hf` backend.

    JAX_PLATFORMS=cpu python benchmarks/harness_throughput.py [--questions 64] [--batch_size 16] [--hidden 256] [--layers 4]

Builds one random Llama directory (word tokenizer, float32, eager attention) and one multiple-choice request set
(--questions contexts of 20-60 words, 4 choices of 1-2 words each), then scores the same requests with both backends
at the same batch size: each backend once to warm up (maxtext compiles its length buckets, torch warms its kernels),
then timed. Prints one JSON line with requests per second of each, the ratio, and the largest per-request difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--questions", type=int, default=64)
  p.add_argument("--batch_size", type=int, default=16)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  args = p.parse_args()

  import torch
  import transformers
  from lm_eval.api.instance import Instance
  from lm_eval.models.huggingface import HFLM

  from maxtext.integrations.lm_eval_backend import MaxTextLM
  from tests.harness_fixtures import WORDS, save_tokenizer

  out = Path(tempfile.mkdtemp(prefix="harness_bench_"))
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
    vocab_size=97,
    hidden_size=args.hidden,
    intermediate_size=args.hidden * 3,
    num_hidden_layers=args.layers,
    num_attention_heads=args.hidden // 32,
    num_key_value_heads=args.hidden // 64,
    head_dim=32,
  )
  transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().save_pretrained(out)
  save_tokenizer(out)

  rng = random.Random(0)
  words = lambda n: " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n))  # noqa: E731
  requests = []
  for q in range(args.questions):
    context = words(rng.randrange(20, 61))
    requests += [Instance("loglikelihood", {}, (context, " " + words(1 + k % 2)), q) for k in range(4)]

  ours = MaxTextLM.create_from_arg_string(f"hf_model_path={out},dtype=float32,max_target_length=128", {"batch_size": args.batch_size})
  theirs = HFLM(pretrained=str(out), dtype="float32", batch_size=args.batch_size, device="cpu", max_length=128)
  result = {"requests": len(requests), "batch_size": args.batch_size, "hidden": args.hidden, "layers": args.layers, "torch_threads": torch.get_num_threads()}
  scores = {}
  for name, lm in (("maxtext", ours), ("hf", theirs)):
    start = time.perf_counter()
    lm.loglikelihood(requests, disable_tqdm=True)
    result[f"{name}_first_call_seconds"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    scores[name] = lm.loglikelihood(requests, disable_tqdm=True)
    seconds = time.perf_counter() - start
    result[f"{name}_requests_per_second"] = round(len(requests) / seconds, 1)
  result["speedup"] = round(result["maxtext_requests_per_second"] / result["hf_requests_per_second"], 2)
  result["max_abs_logprob_difference"] = max(abs(a[0] - b[0]) for a, b in zip(scores["maxtext"], scores["hf"]))
  result["same_greedy_flags"] = [a[1] for a in scores["maxtext"]] == [b[1] for b in scores["hf"]]
  print(json.dumps(result))


if __name__ == "__main__":
  main()
