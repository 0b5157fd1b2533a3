"""`python -m maxtext.train <config.yml> key=value ...`: parse, build, train."""

from __future__ import annotations

import sys

from maxtext.cli import config_usage, entry

USAGE = config_usage(
  "maxtext.train",
  "Train (or resume) a model: the run's own latest checkpoint is restored when one exists, so rerunning\n"
  "the same command continues an interrupted run. Logs one line per step, evaluates every eval_interval steps,\n"
  "saves Orbax checkpoints and writes metrics, TensorBoard events and a plot into the run directory.",
  "python -m maxtext.train configs/quickstart.yml steps=20",
)


@entry(USAGE)
def main(argv: list[str]) -> None:
  from maxtext.config import load
  from maxtext.process import prepare
  from maxtext.train.loop import train

  config = load(argv, devices=prepare)
  if config.lora.enable_lora and config.lora.max_lora_adapters > 1 and not config.lora.adapter_column:
    from maxtext.errors import ConfigError

    raise ConfigError(
      "lora.max_lora_adapters > 1 trains each document on its own adapter; set lora.adapter_column to the data column that names it"
      " (one of lora.lora_adapters, or a slot number)"
    )
  train(config, ends_process=__name__ == "__main__")  # as the program: a signal after the run exits 0 (maxtext.train.preemption)


if __name__ == "__main__":
  main(sys.argv[1:])
