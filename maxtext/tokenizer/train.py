"""Train a sentencepiece tokenizer from text (for users who have none, and for the quickstart)."""

from __future__ import annotations

import glob
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence

from maxtext.errors import DataError

# sentencepiece skips longer input lines; paragraphs are fed one by one.
MAX_PIECE_INPUT_BYTES = 16_384


def train_sentencepiece(texts: Iterable[str], vocab_size: int, out_path: str, model_type: str = "bpe") -> str:
  """Train a sentencepiece model on texts and write it to out_path (atomically); returns out_path.

  Ids: 0 <unk> (also used as padding in batches), 1 <s>, 2 </s>; unknown characters fall back to bytes.
  """
  import sentencepiece as spm

  if vocab_size < 260:
    raise DataError(f"vocab size {vocab_size} is too small for a byte-fallback tokenizer; use at least 260")
  out_dir = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(out_dir, exist_ok=True)
  pieces = _paragraphs(texts)
  first = next(pieces, None)
  if first is None:
    raise DataError("no text to train the tokenizer on; pass files that hold text")
  with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
    prefix = os.path.join(tmp, "sp")
    try:
      spm.SentencePieceTrainer.Train(
        sentence_iterator=_chain(first, pieces),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=0.9995,
        byte_fallback=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        max_sentence_length=MAX_PIECE_INPUT_BYTES,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
      )
    except RuntimeError as e:
      msg = " ".join(str(e).split())[:200]
      raise DataError(f"sentencepiece training failed: {msg}; adjust the vocab size or give more text") from None
    os.replace(prefix + ".model", out_path)
  return out_path


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
  yield first
  yield from rest


def _paragraphs(texts: Iterable[str]) -> Iterator[str]:
  for text in texts:
    for para in text.split("\n\n"):
      para = para.strip()
      while para:
        yield para[: MAX_PIECE_INPUT_BYTES // 4]
        para = para[MAX_PIECE_INPUT_BYTES // 4 :]


def expand_inputs(patterns: Sequence[str]) -> list[str]:
  """Files matching each glob, sorted; a pattern matching nothing is a DataError."""
  files: list[str] = []
  for pattern in patterns:
    matched = sorted(p for p in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(p))
    if not matched:
      raise DataError(f"--input '{pattern}' matches no file; fix the path or glob")
    files += matched
  return files


def read_texts(files: Sequence[str], column: str = "text") -> Iterator[str]:
  """Text of plain files; .jsonl files give the `column` field of each line."""
  for path in files:
    try:
      with open(path, encoding="utf-8") as f:
        if not path.endswith(".jsonl"):
          yield f.read()
          continue
        for lineno, line in enumerate(f, 1):
          if not line.strip():
            continue
          try:
            value = json.loads(line)[column]
          except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{path} line {lineno}: not a JSON object with a '{column}' field; fix the line or pass --column") from None
          if isinstance(value, str):
            yield value
    except (OSError, UnicodeDecodeError) as e:
      raise DataError(f"cannot read '{path}' ({type(e).__name__}); pass UTF-8 text or .jsonl files") from None
