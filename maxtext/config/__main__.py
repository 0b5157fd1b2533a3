"""`python -m maxtext.config <yml> key=value ... [--json]`: print every resolved key and its source."""

from __future__ import annotations

import sys

from maxtext.cli import config_usage, entry
from maxtext.config import render
from maxtext.config.loader import load_with_sources

USAGE = config_usage(
  "maxtext.config",
  "Print every resolved config key, its value and where the value came from\n"
  "(a YAML file, models/<model_name>.yml, command line, env M_<KEY>, default or derived).",
  "python -m maxtext.config configs/base.yml model_name=qwen3-0.6b steps=10",
  'options: --json  print the same as a JSON object {key: {"value": ..., "source": ...}}',
)


@entry(USAGE)
def main(argv: list[str]) -> None:
  as_json = "--json" in argv
  args = [a for a in argv if a != "--json"]
  config, sources = load_with_sources(args)
  table = render.resolved(config, sources)
  print(render.format_json(table) if as_json else render.format_text(table))


if __name__ == "__main__":
  main(sys.argv[1:])
