"""`python -m maxtext.train <config.yml> key=value ...`: parse, build, train."""

from __future__ import annotations

import sys

from maxtext.errors import cli_main


@cli_main
def main(argv: list[str]) -> None:
  from maxtext.config import load
  from maxtext.process import prepare
  from maxtext.train.loop import train

  config = load(argv, before_devices=prepare)
  if config.lora.enable_lora and config.lora.max_lora_adapters > 1:
    from maxtext.errors import ConfigError

    raise ConfigError(
      "lora.max_lora_adapters > 1 needs an adapter_ids batch column, which the built-in data pipelines do not emit yet;"
      " drive maxtext.train.setup.build(...).jit_step with your own batches (docs/mhc_lora.md)"
    )
  train(config)


if __name__ == "__main__":
  main(sys.argv[1:])
