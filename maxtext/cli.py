"""The shared front door of every `python -m maxtext.<entry>`: `-h`/`--help` and one-line errors (the platform is
chosen when the package is imported: maxtext/__init__.py)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from maxtext.errors import cli_main

COMMON_KEYS = """\
common keys (key=value after the config file; every key and its value: python -m maxtext.config <config.yml>):
  model_name=llama3.1-8b          a file of configs/models/ (default: the model keys of the config)
  run_name=r1                     outputs go to <base_output_directory>/<run_name>/{checkpoints,tensorboard}
  base_output_directory=DIR       a local directory (relative to the working directory) or gs://bucket/dir
  steps=N                         optimizer steps to train to
  per_device_batch_size=B         sequences per device per step (fractions allowed when the total is whole)
  max_target_length=L             tokens per sequence
  learning_rate=LR                peak learning rate
  dataset_type=T                  synthetic | embedded | grain | tfds | hf
  load_parameters_path=PATH       start from an Orbax params checkpoint
  eval_interval=N eval_steps=M    evaluate M batches every N steps
Environment variables M_<KEY> set keys too (M_STEPS=10). Reference: docs/config.md."""


def config_usage(prog: str, summary: str, example: str, options: str = "") -> str:
  """Help text of an entry point that takes `<config.yml> key=value ...`."""
  extra = f"\n{options.strip()}\n" if options else ""
  return f"usage: python -m {prog} <config.yml> [key=value ...]\n\n{summary.strip()}\n{extra}\n{COMMON_KEYS}\n\nexample:\n  {example.strip()}"


def wants_help(argv: Sequence[str]) -> bool:
  """-h or --help among the arguments before a '--' (what follows '--' belongs to another program)."""
  head = list(argv[: list(argv).index("--")]) if "--" in argv else list(argv)
  return any(a in ("-h", "--help") for a in head)


def entry(usage: str | Callable[[], str] | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorate `main(argv)`: -h/--help prints `usage` and exits 0 (usage None: main's own argparse answers it);
  otherwise run, a UserError printing `error: ...` and exiting 2."""

  def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    checked = cli_main(fn)

    @functools.wraps(fn)
    def main(argv: Sequence[str] | None = None) -> Any:
      argv = list(sys.argv[1:] if argv is None else argv)
      if usage is not None and wants_help(argv):
        print(usage() if callable(usage) else usage)
        return 0
      return checked(argv)

    return main

  return wrap
