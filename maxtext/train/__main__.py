"""`python -m maxtext.train <config.yml> key=value ...`: parse, build, train."""

from __future__ import annotations

import sys

from maxtext.errors import cli_main


@cli_main
def main(argv: list[str]) -> None:
  from maxtext.config import load
  from maxtext.process import prepare
  from maxtext.train.loop import train

  train(load(argv, before_devices=prepare))


if __name__ == "__main__":
  main(sys.argv[1:])
