"""Generate maxtext/config/maxtext_keys.json: every MaxText config key and its default.

Sources: MaxText's config reference (the `maxtext.configs.types` documentation in shared/seeds/004_*.txt: the
signature of `MaxTextConfig` names every key with its pydantic default) and `configs/base.yml` inside the
maxtext==0.2.5 wheel (the defaults a MaxText run actually starts from; they win where the two differ).
A key whose default neither source states (a pydantic default factory) is listed without one.

  python scripts/generate_maxtext_keys.py [--seed FILE] [--wheel maxtext-0.2.5-py3-none-any.whl]

Without --wheel the wheel is fetched with `pip download --no-deps maxtext==0.2.5` into a temporary directory.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "maxtext" / "config" / "maxtext_keys.json"
VERSION = "0.2.5"
WHEEL_BASE_YML = "maxtext/configs/base.yml"
_ENUM_CLASS = re.compile(r"^- class maxtext\.configs\.types\.(\w+)\(\*values\)")
_ENUM_MEMBER = re.compile(r"^- (\w+) = (.+)#$")
_CONFIG_SIGNATURE = re.compile(r"^- class maxtext\.configs\.types\.MaxTextConfig\(\*, (.*)\)\[source\]#$")
UNKNOWN = object()


def split_top_level(text: str) -> list[str]:
  """Split 'a=1, b=[1, 2], c='x, y'' at the commas outside brackets and quotes."""
  parts, depth, quote, current = [], 0, "", []
  for ch in text:
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append("".join(current).strip())
      current = []
      continue
    current.append(ch)
  if "".join(current).strip():
    parts.append("".join(current).strip())
  return parts


def parse_seed(text: str) -> dict[str, Any]:
  """key -> pydantic default (UNKNOWN for default factories) from the MaxTextConfig signature; enums as their values."""
  enums: dict[str, Any] = {}
  current = None
  signature = None
  for line in text.splitlines():
    if m := _ENUM_CLASS.match(line):
      current = m.group(1)
    elif current and (m := _ENUM_MEMBER.match(line)):
      enums[f"{current}.{m.group(1)}"] = ast.literal_eval(m.group(2))
    elif line.startswith("- class"):
      current = None
    if m := _CONFIG_SIGNATURE.match(line):
      signature = m.group(1)
  if signature is None:
    raise SystemExit("the seed has no MaxTextConfig signature; pass MaxText's config reference (shared/seeds/004_*.txt)")
  defaults: dict[str, Any] = {}
  for part in split_top_level(signature):
    name, _, value = part.partition("=")
    if value in enums:
      defaults[name] = enums[value]
      continue
    try:
      defaults[name] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      defaults[name] = UNKNOWN  # <factory>
  return defaults


def _yaml(text: str) -> dict[str, Any]:
  """A YAML mapping read as maxtext reads any config file (so `1e-5` is a float here as there)."""
  if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
  from maxtext.config.yaml_files import yaml_load

  return yaml_load(text, "a MaxText config")


def _yaml_base(path: Path) -> dict[str, Any]:
  return _yaml(path.read_text())


def read_wheel_base_yml(wheel: Path) -> dict[str, Any]:
  with zipfile.ZipFile(wheel) as z:
    return _yaml(z.read(WHEEL_BASE_YML).decode())


def fetch_wheel(directory: str) -> Path:
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", f"maxtext=={VERSION}", "-d", directory]
  subprocess.run(cmd, check=True)
  return next(Path(directory).glob(f"maxtext-{VERSION}-*.whl"))


def generate(seed_text: str, base: dict[str, Any]) -> dict[str, Any]:
  seed = parse_seed(seed_text)
  keys: dict[str, Any] = {}
  for name in sorted(set(seed) | set(base)):
    if name in base:
      keys[name] = {"default": base[name]}
    elif seed[name] is not UNKNOWN:
      keys[name] = {"default": seed[name]}
    else:
      keys[name] = {}
  return {
    "generated_by": "scripts/generate_maxtext_keys.py",
    "sources": [f"MaxText {VERSION} configs/base.yml (defaults)", "MaxText config reference, MaxTextConfig signature (names, other defaults)"],
    "keys": keys,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  seeds = sorted(glob.glob(str(ROOT.parent / "shared" / "seeds" / "004_*.txt"))) + sorted(glob.glob("/work/shared/seeds/004_*.txt"))
  parser.add_argument("--seed", default=seeds[0] if seeds else None, help="MaxText's config reference (shared/seeds/004_*.txt)")
  parser.add_argument("--wheel", help=f"maxtext-{VERSION} wheel (default: pip download it)")
  parser.add_argument("--out", default=str(OUT))
  args = parser.parse_args()
  if not args.seed:
    raise SystemExit("no seed found; pass --seed shared/seeds/004_*.txt")
  with tempfile.TemporaryDirectory() as tmp:
    wheel = Path(args.wheel) if args.wheel else fetch_wheel(tmp)
    data = generate(Path(args.seed).read_text(), read_wheel_base_yml(wheel))
  Path(args.out).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
  print(f"wrote {args.out}: {len(data['keys'])} keys")


if __name__ == "__main__":
  main()
