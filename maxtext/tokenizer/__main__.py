"""`python -m maxtext.tokenizer train --input FILES --vocab-size N --out PATH`: train a sentencepiece model."""

from __future__ import annotations

import argparse
import os

from maxtext.cli import entry
from maxtext.errors import DataError
from maxtext.tokenizer.train import expand_inputs, read_texts, train_sentencepiece


def parse(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m maxtext.tokenizer",
    description=__doc__,
    epilog="example:\n  python -m maxtext.tokenizer train --input 'corpus/*.txt' --vocab-size 8000 --out tok.model\n"
    "then train with tokenizer_type=sentencepiece tokenizer_path=tok.model",
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  sub = parser.add_subparsers(dest="command", required=True)
  train = sub.add_parser("train", help="train a sentencepiece tokenizer on text files")
  train.add_argument("--input", nargs="+", required=True, help="text or .jsonl files (globs allowed)")
  train.add_argument("--vocab-size", type=int, required=True, help="number of tokens")
  train.add_argument("--out", required=True, help="where to write the .model file (must not exist)")
  train.add_argument("--column", default="text", help="field of .jsonl lines holding the text")
  train.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"], help="sentencepiece algorithm")
  return parser.parse_args(argv)


@entry(None)
def main(argv: list[str] | None = None) -> None:
  args = parse(argv)
  if os.path.exists(args.out):
    raise DataError(f"--out '{args.out}' already exists; choose another path or delete it")
  files = expand_inputs(args.input)
  path = train_sentencepiece(read_texts(files, args.column), args.vocab_size, args.out, args.model_type)
  print(f"wrote {path} ({args.vocab_size} tokens, trained on {len(files)} files)")


if __name__ == "__main__":
  main()
