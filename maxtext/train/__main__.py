"""`python -m maxtext.train <config.yml> key=value ...`: parse, build, train."""

from __future__ import annotations

import sys

from maxtext.errors import cli_main


@cli_main
def main(argv: list[str]) -> None:
  from maxtext import distributed
  from maxtext.config import load
  from maxtext.train.loop import train

  train(load(argv, before_devices=distributed.initialize))


if __name__ == "__main__":
  main(sys.argv[1:])
