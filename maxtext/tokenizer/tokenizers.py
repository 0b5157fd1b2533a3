"""Tokenizers behind one small interface: sentencepiece, Hugging Face and tiktoken."""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from typing import Protocol

from maxtext.errors import DataError

# Split pattern of Llama 3's tiktoken tokenizer: words, numbers of up to 3 digits, punctuation, spaces.
TIKTOKEN_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# BOS/EOS of a bare tokenizer.json (no tokenizer_config.json naming them): the first of these in the vocabulary.
HF_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>")
HF_EOS_NAMES = ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>")
TIKTOKEN_BOS = "<|begin_of_text|>"
TIKTOKEN_EOS = "<|end_of_text|>"


class Tokenizer(Protocol):
  """What the data pipeline needs from a tokenizer."""

  path: str
  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  chat_template: str | None
  special_tokens: dict[str, str]

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class SentencePieceTokenizer:
  """A sentencepiece .model file."""

  def __init__(self, path: str):
    import sentencepiece as spm

    self.path = path
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.Load(path)
    except (OSError, RuntimeError) as e:
      raise DataError(f"tokenizer_path '{path}' is not a readable sentencepiece model ({one_word(e)}); pass a .model file or set tokenizer_type") from None
    self.vocab_size = int(self._sp.GetPieceSize())
    self.bos_id = _valid_id(self._sp.bos_id())
    self.eos_id = _valid_id(self._sp.eos_id())
    self.chat_template = None
    self.special_tokens = {
      "bos_token": self._sp.IdToPiece(self.bos_id) if self.bos_id is not None else "",
      "eos_token": self._sp.IdToPiece(self.eos_id) if self.eos_id is not None else "",
    }

  def encode(self, text: str) -> list[int]:
    return self._sp.EncodeAsIds(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self._sp.DecodeIds([int(i) for i in ids])

  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])


class HuggingFaceTokenizer:
  """A Hugging Face tokenizer.json file or a local directory with one (never downloads)."""

  def __init__(self, path: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    self.path = path
    try:
      if os.path.isdir(path):
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
      else:
        tok = PreTrainedTokenizerFast(tokenizer_file=path)
    except Exception as e:  # transformers raises many types for a bad file
      raise DataError(
        f"tokenizer_path '{path}' is not a readable Hugging Face tokenizer ({one_word(e)}); pass a tokenizer.json or a directory holding one"
      ) from None
    vocab = tok.get_vocab()
    bos = tok.bos_token or next((t for t in HF_BOS_NAMES if t in vocab), None)
    eos = tok.eos_token or next((t for t in HF_EOS_NAMES if t in vocab), None)
    self._tok = tok
    self.vocab_size = len(tok)
    self.bos_id = vocab[bos] if bos in vocab else None
    self.eos_id = vocab[eos] if eos in vocab else None
    self.chat_template = tok.chat_template if isinstance(tok.chat_template, str) else None
    self.special_tokens = {"bos_token": bos or "", "eos_token": eos or ""}

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode([int(i) for i in ids])

  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])


class TiktokenTokenizer:
  """A tiktoken BPE file (lines of `<base64 token> <rank>`), split like Llama 3; BOS/EOS follow the ranks."""

  def __init__(self, path: str):
    import tiktoken

    self.path = path
    ranks = read_tiktoken_ranks(path)
    n = max(ranks.values()) + 1
    specials = {TIKTOKEN_BOS: n, TIKTOKEN_EOS: n + 1}
    self._enc = tiktoken.Encoding(os.path.basename(path), pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    self.vocab_size = n + 2
    self.bos_id, self.eos_id = n, n + 1
    self.chat_template = None
    self.special_tokens = {"bos_token": TIKTOKEN_BOS, "eos_token": TIKTOKEN_EOS}

  def encode(self, text: str) -> list[int]:
    return self._enc.encode_ordinary(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self._enc.decode([int(i) for i in ids])

  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
  """Parse a tiktoken BPE file; a malformed line is a DataError naming the line."""
  ranks: dict[bytes, int] = {}
  try:
    with open(path, "rb") as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          token, rank = line.split()
          ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
          raise DataError(f"tokenizer_path '{path}' line {lineno} is not '<base64 token> <rank>'; pass a tiktoken BPE file") from None
  except OSError as e:
    raise DataError(f"tokenizer_path '{path}' cannot be read ({one_word(e)}); pass a tiktoken BPE file") from None
  if not ranks:
    raise DataError(f"tokenizer_path '{path}' holds no tokens; pass a tiktoken BPE file")
  return ranks


def load_tokenizer(tokenizer_type: str, path: str) -> Tokenizer:
  """The tokenizer of tokenizer_type at path; a missing or unreadable one is a DataError naming the path."""
  if not path:
    raise DataError("tokenizer_path is empty; set tokenizer_path to a tokenizer file (see docs/data.md)")
  if not os.path.exists(path):
    raise DataError(f"tokenizer_path '{path}' does not exist; fix the path or train one with `python -m maxtext.tokenizer train`")
  if tokenizer_type == "sentencepiece":
    return SentencePieceTokenizer(path)
  if tokenizer_type == "huggingface":
    return HuggingFaceTokenizer(path)
  if tokenizer_type == "tiktoken":
    return TiktokenTokenizer(path)
  raise DataError(f"unknown tokenizer_type '{tokenizer_type}'; use sentencepiece, huggingface or tiktoken")


def one_word(e: BaseException) -> str:
  """A short, single-line reason for an exception."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:120]}" if text else type(e).__name__


def _valid_id(i: int) -> int | None:
  return None if i < 0 else int(i)
