"""`python -m maxtext.decode <config.yml> key=value ...`: complete `prompt` with a trained or converted model."""

from __future__ import annotations

import sys

from maxtext.errors import cli_main


@cli_main
def main(argv: list[str]) -> None:
  from maxtext.config import load
  from maxtext.inference.cli import run
  from maxtext.process import prepare

  config = load(argv, devices=prepare)
  run(config, argv)


if __name__ == "__main__":
  main(sys.argv[1:])
