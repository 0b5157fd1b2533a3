"""The finetuning workflow on a Hugging Face chat model, as a user runs it: LoRA SFT straight from the HF directory
with its chat template until its data is used up, the continuation the run prints (a new run from its state, on the
same HF base), decode with the template (stopping at its end-of-turn token), lora-to-peft --merge, then
transformers loads the merged directory's tokenizer and its generate stops where ours does."""

from __future__ import annotations

import json
import re
import sys

from tests import cli_server
from tests.test_bad_inputs import REPO, _env

BASE = str(REPO / "configs" / "base.yml")
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
WORDS = ["user", "assistant", "system", "hi", "hello", "ping", "pong", "yes", "no", "cat", "dog", "the", "a", "is", "what"]


def save_chat_model(d):
  """A tiny random Llama with a word-level tokenizer, ChatML template, <|im_end|> as EOS in generation_config.json."""
  import tokenizers
  import torch
  import transformers

  specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
  vocab = {t: i for i, t in enumerate(specials + WORDS)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>")
  fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
  fast.chat_template = CHATML
  fast.save_pretrained(d)
  torch.manual_seed(0)
  end = vocab["<|im_end|>"]
  config = transformers.LlamaConfig(
    vocab_size=len(vocab),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    eos_token_id=end,
    pad_token_id=0,
    bos_token_id=None,
  )
  model = transformers.AutoModelForCausalLM.from_config(config)
  # LoRA leaves the output head frozen; at the default init (std 0.02) its logits span about +-0.6, too flat for any
  # adapter to make one token likely (the loss cannot fall below ~2.5). A unit-scale head lets the adapters decide.
  torch.nn.init.normal_(model.lm_head.weight, std=0.3)
  model.generation_config = transformers.GenerationConfig(eos_token_id=end, pad_token_id=0, do_sample=False)
  model.save_pretrained(d)


def _run(*argv, cwd):
  proc = cli_server.run([sys.executable, "-m", *argv], env=_env(), cwd=cwd, timeout=600)  # a process of its own, forked warm
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc.stdout + proc.stderr


def test_lora_sft_decode_and_merge_from_an_hf_chat_model(tmp_path):
  import transformers

  hf = tmp_path / "chat"
  save_chat_model(hf)
  data = tmp_path / "sft.jsonl"
  rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "yes dog"}]} for q in ("hi", "hello", "ping", "what is")]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
  run = [
    BASE,
    f"load_parameters_path={hf}",
    "use_sft=true",
    "train_data_columns=[messages]",
    "dataset_type=grain",
    "grain_file_type=jsonl",
    f"grain_train_files={data}",
    "lora.enable_lora=true",
    "lora.lora_rank=8",
    "lora.lora_alpha=16",
    "max_target_length=16",
    "per_device_batch_size=1",
    "add_bos=false",
    f"base_output_directory={tmp_path}/out",
    "run_name=ft",
    "async_checkpointing=false",
    "dtype=float32",
    "weight_dtype=float32",
    "enable_tensorboard=false",  # no event files or plot: cheaper
  ]
  train = _run("maxtext.train", *run, "steps=100", "learning_rate=0.02", "warmup_steps_fraction=0", "num_epoch=2", cwd=tmp_path)
  assert f"loaded parameters from {hf}" in train
  assert "data used up after 2 epochs at step 32" in train, train[-1500:]
  # the run names how to train further; run it as printed, under a new run name
  keys = re.search(r"start a new run from the last state: (.*) \(its data starts from the beginning\)$", train, re.M).group(1)
  assert "<new name>" in keys
  more = _run(
    "maxtext.train",
    *run,
    "steps=100",
    "learning_rate=0.02",
    "warmup_steps_fraction=0",
    "num_epoch=2",
    *keys.replace("<new name>", "more").split(),
    cwd=tmp_path,
  )
  assert f"loaded parameters from {hf}" in more  # the frozen HF base under the restored adapters
  assert "steps 32 -> 64" in more, more[-1500:]
  first, last = _losses(train)[0], _losses(train)[-1]
  resumed = _losses(more)[0]
  assert last < 0.2 and resumed < last + 0.2 < first / 10, (first, last, resumed)  # it goes on from where it ended, not from scratch
  run = [*run, "run_name=more"]
  ckpt = tmp_path / "out" / "more" / "checkpoints" / "64"
  assert ckpt.is_dir()
  decode = _run("maxtext.decode", *run, "use_chat_template=true", "prompt=hi", "max_prefill_predict_length=8", cwd=tmp_path)
  assert "prompt: <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in decode  # the template's rendering of the prompt
  completion = re.search(r"^completion: (.*)$", decode, re.M).group(1)
  assert completion == "yes dog", decode[-1500:]  # the trained reply, then the template's end token ends it
  assert re.search(r"decode: 3 tokens", decode), decode[-800:]  # yes, dog, <|im_end|>: it stopped there, short of max_target_length
  merged = tmp_path / "merged"
  _run("maxtext.convert", "lora-to-peft", "--merge", "--checkpoint", str(ckpt), "--out", str(merged), "--config", *run, cwd=tmp_path)
  tok = transformers.AutoTokenizer.from_pretrained(merged)  # the merged directory carries the tokenizer and generation_config.json
  model = transformers.AutoModelForCausalLM.from_pretrained(merged)
  end = tok.convert_tokens_to_ids("<|im_end|>")
  assert model.generation_config.eos_token_id == end
  ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
  assert ids.shape[1] == 6  # the 6 prompt tokens decode prefilled
  out = model.generate(ids, max_new_tokens=16 - 6)[0, ids.shape[1] :].tolist()
  # generate stops where ours does: the trained reply, then the end-of-turn token
  assert out == tok.convert_tokens_to_ids(["yes", "dog"]) + [end], tok.convert_ids_to_tokens(out)


def _losses(out: str) -> list[float]:
  return [float(x) for x in re.findall(r"^completed step: \d+, .*? loss: ([0-9.]+),", out, re.M)]
