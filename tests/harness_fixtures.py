"""A tiny Llama Hugging Face directory with a word-level tokenizer, and two local lm-evaluation-harness tasks (multiple
choice and generation, jsonl + YAML): what tests/test_harness.py and benchmarks/harness_throughput.py run on."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = 90  # w0 .. w89 after <unk>, <s>, </s>: 93 tokens <= the model's 97

CHOICE_YAML = """\
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GEN_YAML = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["w7"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def save_tokenizer(out_dir: Path) -> None:
  """A whitespace word-level tokenizer that prepends <s> (as Llama's does), with tokenizer_config.json naming BOS/EOS."""
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast

  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
  fast.save_pretrained(out_dir)


def save_model_dir(out_dir: Path) -> Path:
  """The tiny random Llama (tests/hf_fixtures.py) with the word tokenizer, saved to out_dir."""
  from tests.hf_fixtures import save_tiny_model

  save_tiny_model("llama2", out_dir)
  save_tokenizer(out_dir)
  return out_dir


def _sentence(rng: random.Random, n: int) -> str:
  return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n))


def save_tasks(out_dir: Path, docs: int = 4, seed: int = 0) -> Path:
  """tiny_choice (docs questions, 4 one- or two-word choices) and tiny_gen (docs prompts) under out_dir."""
  rng = random.Random(seed)
  out_dir.mkdir(parents=True, exist_ok=True)
  with open(out_dir / "choice.jsonl", "w") as f:
    for _ in range(docs):
      choices = [_sentence(rng, 1 + (k % 2)) for k in range(4)]
      f.write(json.dumps({"question": _sentence(rng, rng.randrange(3, 12)), "choices": choices, "answer": rng.randrange(4)}) + "\n")
  with open(out_dir / "gen.jsonl", "w") as f:
    for _ in range(docs):
      f.write(json.dumps({"prompt": _sentence(rng, rng.randrange(2, 9)), "target": _sentence(rng, 2)}) + "\n")
  (out_dir / "tiny_choice.yaml").write_text(CHOICE_YAML.format(data=out_dir / "choice.jsonl"))
  (out_dir / "tiny_gen.yaml").write_text(GEN_YAML.format(data=out_dir / "gen.jsonl"))
  return out_dir
