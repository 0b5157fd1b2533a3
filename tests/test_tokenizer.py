"""Tokenizers: sentencepiece, Hugging Face (file and directory), tiktoken; the training CLI; one-line errors."""

from __future__ import annotations

import base64
import subprocess
import sys

import pytest

from maxtext.errors import DataError
from maxtext.tokenizer import load_tokenizer
from maxtext.tokenizer.__main__ import main as tokenizer_main
from tests.test_data_common import WORDS, doc_text, sp_model

TEXT = "the model reads text and learns"


def test_sentencepiece_roundtrip_and_specials():
  tok = load_tokenizer("sentencepiece", sp_model())
  assert tok.vocab_size == 320 and (tok.bos_id, tok.eos_id) == (1, 2)
  ids = tok.encode(TEXT)
  assert ids and tok.bos_id not in ids and tok.decode(ids) == TEXT
  assert tok.decode(tok.encode("naïve ☃ 42")) == "naïve ☃ 42", "byte fallback covers unseen characters"


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator([doc_text(i) for i in range(50)], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tok.save(str(path))
  return path


def test_huggingface_file_and_directory(hf_tokenizer_json, tmp_path):
  from transformers import PreTrainedTokenizerFast

  tok = load_tokenizer("huggingface", str(hf_tokenizer_json))
  assert (tok.bos_id, tok.eos_id) == (1, 2), "a bare tokenizer.json: <s> and </s> are found by name"
  ids = tok.encode(TEXT)
  assert tok.decode(ids).replace(" ", "") == TEXT.replace(" ", "")
  fast = PreTrainedTokenizerFast(tokenizer_file=str(hf_tokenizer_json), bos_token="<s>", eos_token="</s>")
  fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
  fast.save_pretrained(tmp_path / "dir")
  from_dir = load_tokenizer("huggingface", str(tmp_path / "dir"))
  assert from_dir.encode(TEXT) == ids and from_dir.bos_id == 1 and "messages" in from_dir.chat_template


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
  ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"re", b"ad"]
  path = tmp_path_factory.mktemp("tt") / "tiny.tiktoken"
  path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
  return path


def test_tiktoken_bpe_file(tiktoken_file):
  tok = load_tokenizer("tiktoken", str(tiktoken_file))
  assert tok.vocab_size == 263 and (tok.bos_id, tok.eos_id) == (261, 262)
  ids = tok.encode("the model reads the text")
  assert 259 in ids and 260 in ids and tok.decode(ids) == "the model reads the text"
  assert tok.encode("<|begin_of_text|>") != [tok.bos_id], "special-token text in documents is not a special token"


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface", "tiktoken"])
def test_missing_or_unreadable_tokenizer_is_one_line_error(kind, tmp_path):
  with pytest.raises(DataError, match="does not exist") as missing:
    load_tokenizer(kind, str(tmp_path / "nope.model"))
  assert str(tmp_path / "nope.model") in str(missing.value)
  bad = tmp_path / "garbage.bin"
  bad.write_bytes(b"\x00\x01 not a tokenizer \xff\n")
  with pytest.raises(DataError) as unreadable:
    load_tokenizer(kind, str(bad))
  assert str(bad) in str(unreadable.value) and "\n" not in str(unreadable.value)


def test_train_cli_writes_model_and_refuses_to_overwrite(tmp_path, capsys):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n\n".join(doc_text(i) for i in range(100)))
  jsonl = tmp_path / "more.jsonl"
  jsonl.write_text("".join(f'{{"body": "{" ".join(WORDS)} {i}"}}\n' for i in range(20)))
  out = tmp_path / "sp.model"
  tokenizer_main(["train", "--input", str(tmp_path / "*.txt"), str(jsonl), "--column", "body", "--vocab-size", "300", "--out", str(out)])
  assert "wrote" in capsys.readouterr().out
  tok = load_tokenizer("sentencepiece", str(out))
  assert tok.vocab_size == 300 and tok.decode(tok.encode(doc_text(3))) == doc_text(3)
  before = out.read_bytes()
  with pytest.raises(SystemExit) as e:
    tokenizer_main(["train", "--input", str(corpus), "--vocab-size", "300", "--out", str(out)])
  assert e.value.code == 2 and "already exists" in capsys.readouterr().err
  assert out.read_bytes() == before


def test_train_cli_bad_input_exits_2(tmp_path):
  proc = subprocess.run(
    [sys.executable, "-m", "maxtext.tokenizer", "train", "--input", str(tmp_path / "none*.txt"), "--vocab-size", "300", "--out", str(tmp_path / "x.model")],
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 2
  assert proc.stderr.strip().startswith("error: --input") and len(proc.stderr.strip().splitlines()) == 1
