"""SFT data: chat templates, prompt/completion columns, and the loss mask token by token."""

from __future__ import annotations

import numpy as np
import pytest

from maxtext.data import pipeline
from maxtext.errors import ConfigError, DataError
from maxtext.tokenizer import load_tokenizer
from tests.test_data_common import check_row_invariants, config, sp_model, write_jsonl

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
CONVERSATION = [
  {"role": "system", "content": "the model reads text"},
  {"role": "user", "content": "predict the next token"},
  {"role": "assistant", "content": "the next token of every document"},
  {"role": "user", "content": "and the data set"},
  {"role": "assistant", "content": "learns to predict"},
]


def first_row(cfg) -> dict[str, np.ndarray]:
  ds, _ = pipeline.local_batches(cfg, "train", 0, 1, cfg.global_batch_size_to_train_on)
  batch = next(iter(ds))
  check_row_invariants(batch)
  return {k: v[0] for k, v in batch.items()}


def trained_targets(row) -> np.ndarray:
  return row["targets"][row["targets_segmentation"] != 0]


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer("sentencepiece", sp_model())


def sft_config(path, **kw):
  base = dict(grain_train_files=str(path), use_sft=True, train_data_columns=["messages"], packing=False, max_target_length=128, per_device_batch_size=0.125)
  base.update(kw)
  return config(**base)


def test_messages_mask_token_by_token(tmp_path, tok):
  path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
  row = first_row(sft_config(path, chat_template=TEMPLATE))
  # Expected tokens, built piece by piece: prompt parts (template text, user/system turns) get weight 0.
  pieces = [
    ("<|system|>the model reads text\n<|user|>predict the next token\n<|assistant|>", 0),
    ("the next token of every document\n", 1),
    ("<|user|>and the data set\n<|assistant|>", 0),
    ("learns to predict\n", 1),
  ]
  tokens, weights = [tok.bos_id], [0]
  for text, w in pieces:
    ids = tok.encode(text)
    tokens += ids
    weights += [w] * len(ids)
  tokens.append(tok.eos_id)
  weights.append(1)  # EOS after the last assistant turn is trained on
  n = len(tokens)
  np.testing.assert_array_equal(row["inputs"][:n], tokens)
  # targets_segmentation[i] != 0 exactly when token i + 1 is a completion token
  np.testing.assert_array_equal(row["targets_segmentation"][: n - 1] != 0, np.asarray(weights[1:]) == 1)
  assert row["targets_segmentation"][n - 1] == 0 and not row["targets_segmentation"][n:].any()
  trained = trained_targets(row).tolist()
  assert trained[-1] == tok.eos_id
  assert tok.decode(trained[:-1]).replace("\n", "|") == tok.decode(
    tok.encode("the next token of every document\n") + tok.encode("learns to predict\n")
  ).replace("\n", "|")


def test_train_on_everything_when_completion_only_is_off(tmp_path):
  path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
  row = first_row(sft_config(path, chat_template=TEMPLATE, sft_train_on_completion_only=False))
  n = int((row["inputs_segmentation"] > 0).sum())
  assert (row["targets_segmentation"][: n - 1] == 1).all() and not row["targets_segmentation"][n - 1 :].any()


def test_prompt_completion_columns(tmp_path, tok):
  path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "the model reads ", "completion": "text and learns"}])
  row = first_row(sft_config(path, train_data_columns=["prompt", "completion"]))
  n_prompt = len(tok.encode("the model reads "))
  np.testing.assert_array_equal(row["targets_segmentation"][:n_prompt], 0)  # BOS..prompt predict prompt tokens: no weight
  assert trained_targets(row).tolist() == tok.encode("text and learns") + [tok.eos_id]


def test_template_sources_and_errors(tmp_path):
  path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
  template_file = tmp_path / "template.jinja"
  template_file.write_text(TEMPLATE)
  from_file = first_row(sft_config(path, chat_template_path=str(template_file)))
  inline = first_row(sft_config(path, chat_template=TEMPLATE))
  np.testing.assert_array_equal(from_file["targets_segmentation"], inline["targets_segmentation"])
  with pytest.raises(ConfigError, match="chat template"):
    first_row(sft_config(path))  # sentencepiece has no template of its own
  with pytest.raises(ConfigError, match="both set"):
    first_row(sft_config(path, chat_template=TEMPLATE, chat_template_path=str(template_file)))
  with pytest.raises(ConfigError, match="syntax error"):
    first_row(sft_config(path, chat_template="{% for m in messages %}"))
  bad = write_jsonl(tmp_path / "bad.jsonl", ["", {"messages": [{"role": "user"}]}, {"messages": CONVERSATION}])
  with pytest.raises(DataError, match=r"bad.jsonl line 2: each turn needs"):
    first_row(sft_config(bad, chat_template=TEMPLATE))


def test_tokenizer_own_chat_template(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  raw = Tokenizer(models.BPE(unk_token="<unk>"))
  raw.pre_tokenizer = pre_tokenizers.Whitespace()
  raw.train_from_iterator([t["content"] for t in CONVERSATION] * 5, trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<s>", "</s>"]))
  raw.save(str(tmp_path / "tokenizer.json"))
  fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
  fast.chat_template = TEMPLATE
  fast.save_pretrained(tmp_path / "tok")
  path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
  row = first_row(sft_config(path, tokenizer_type="huggingface", tokenizer_path=str(tmp_path / "tok")))
  tok = load_tokenizer("huggingface", str(tmp_path / "tok"))
  trained = trained_targets(row).tolist()
  assert trained == tok.encode("the next token of every document\n") + tok.encode("learns to predict\n") + [tok.eos_id]


def test_parquet_messages_column(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  jsonl = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
  pq.write_table(pa.table({"messages": [CONVERSATION]}), tmp_path / "chat.parquet")
  from_parquet = first_row(sft_config(tmp_path / "chat.parquet", grain_file_type="parquet", chat_template=TEMPLATE))
  from_jsonl = first_row(sft_config(jsonl, chat_template=TEMPLATE))
  for k in ("inputs", "targets_segmentation"):
    np.testing.assert_array_equal(from_parquet[k], from_jsonl[k])
