"""`python -m maxtext.harness <lm_eval arguments>`: lm-evaluation-harness's own command line, with maxtext's backend
registered as `--model maxtext` (the harness's CLI finds no third-party backends by itself).

  python -m maxtext.harness --model maxtext --model_args hf_model_path=DIR,dtype=float32 --tasks T --include_path TASKS

`--model_args` are maxtext config keys (`config=<yml>` picks the YAML file, default configs/base.yml). A task name the
harness does not know is a one-line error (exit 2) before any model is loaded. docs/evaluation.md has the rest.
"""

from __future__ import annotations

import sys

from maxtext.cli import entry
from maxtext.errors import ConfigError


@entry(None)  # the harness's argparse answers -h/--help
def main(argv: list[str]) -> None:
  from maxtext.integrations import require_lm_eval

  require_lm_eval()
  from lm_eval._cli import HarnessCLI
  from lm_eval.utils import setup_logging

  import maxtext.integrations.lm_eval_backend  # noqa: F401  (registers --model maxtext)

  setup_logging()
  cli = HarnessCLI()
  saved, sys.argv = sys.argv, ["python -m maxtext.harness", *argv]  # HarnessCLI reads sys.argv (and inserts `run` when no subcommand is given)
  try:
    args = cli.parse_args()
  finally:
    sys.argv = saved
  try:
    cli.execute(args)
  except ValueError as e:
    missing = str(e).removeprefix("Tasks not found: ")
    if missing == str(e):
      raise
    raise ConfigError(
      f"unknown harness task(s) {missing}; pass task names the harness lists (python -m maxtext.harness ls tasks), "
      "YAML task files, or --include_path with the directory of your task YAML files"
    ) from None


if __name__ == "__main__":
  main(sys.argv[1:])
