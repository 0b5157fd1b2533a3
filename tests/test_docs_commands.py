"""Every shell command printed in README.md and docs/*.md runs as printed, from a fresh clone, on CPU.

Convention for doc writers:
- Fenced ```bash blocks are executed, in document order (README.md first, then docs/*.md alphabetically), one
  command per line (a trailing `\\` continues a line, `# ...` comments are ignored, leading VAR=value words set
  environment variables), each in a process of its own (without such words, forked from tests/cli_server.py's
  server, which imported maxtext's dependencies once), all in one temporary working directory that holds only a
  `configs` link to the repository's configs/ (as a user's fresh clone would have). So a later block may use what
  an earlier one wrote (the quickstart's run directory, a plot).
- Only `python -m maxtext.<entry> ...` commands run. A block that cannot run on a CPU CI machine, or shows a
  template with placeholders, is marked by the line `<!-- docs-test: skip (reason) -->` right before its fence;
  any other command in an unmarked block fails this test. Fences indented inside list items count; indented
  (4-space) code without a fence is not executed.
- JAX_PLATFORMS and XLA_FLAGS are removed from the environment, as on a new user's machine: the entry points must
  pick the platform themselves and print no libtpu/TPU-runtime message. XLA_FLAGS is then the command's own (a
  leading XLA_FLAGS=... word) followed by the tests' fast-compile flags (tests/xla_env.py), never a forced device
  count: maxtext reads nothing from XLA_FLAGS but that count (maxtext.platform.predicted_device_counts), so a command
  sees the devices a user's machine has, and the flags change only XLA's code generation (the quickstart's 2-step
  train: 32 -> 20 CPU s; its decode: 17 -> 11 CPU s).

What is checked: exit code 0 and some output; training commands run with `steps` set small (replaced, or appended)
and must report an existing checkpoint directory; the first training command is run again with one more step and
must print the resume line `restored checkpoint at step N`; `--out FILE` of maxtext.plot must exist afterwards.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import cli_server
from tests.xla_env import FAST_COMPILE_FLAGS

ROOT = Path(__file__).resolve().parents[1]
SKIP_MARKER = re.compile(r"<!--\s*docs-test:\s*skip\b")
FENCE = re.compile(r"^[ \t]*```(?:bash|sh|shell)[ \t]*\n(.*?)^[ \t]*```", re.S | re.M)  # list items indent their fences
TRAIN_STEPS = 2
TPU_NOISE = ("Failed to find host bounds", "unexpected worker hostname", "libtpu", "TPU_ACCELERATOR_TYPE", "InitGoogle")


def doc_files() -> list[Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands(path: Path) -> list[tuple[str, int, list[str], dict[str, str]]]:
  """(file:line, line, argv, env) of every command in the runnable bash blocks of a markdown file."""
  text = path.read_text()
  out = []
  for block in FENCE.finditer(text):
    before = text[: block.start()].rstrip().splitlines()
    if before and SKIP_MARKER.search(before[-1]):
      continue
    first_line = text[: block.start()].count("\n") + 2
    joined = textwrap.dedent(block.group(1)).replace("\\\n", " ")
    for offset, line in enumerate(joined.splitlines()):
      words = shlex.split(line, comments=True)
      if not words:
        continue
      env = {}
      while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
      out.append((f"{path.relative_to(ROOT)}:{first_line + offset}", first_line + offset, words, env))
  return out


def with_steps(argv: list[str], steps: int) -> list[str]:
  return [a for a in argv if not a.startswith("steps=")] + [f"steps={steps}"]


TIMES: list[tuple[float, str]] = []  # (wall s, command): printed with -s


def environment(env: dict[str, str]) -> dict[str, str]:
  """A new user's environment (no JAX_PLATFORMS, the command's own XLA_FLAGS) with the command's leading VAR=value words."""
  full_env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS") and not k.startswith("M_")}
  full_env.update(env, PYTHONPATH=str(ROOT))
  full_env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()  # a command's own XLA_FLAGS, then the fast ones
  return full_env


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
  """The command in a process of its own. Without VAR=value words (most commands) it is forked from
  tests/cli_server.py's warm server and skips only the imports a new process pays (the server's own output while
  importing is checked in the test); a command with its own environment is rare, and a new process is cheaper than
  a server of its own."""
  start = time.perf_counter()
  command, full_env = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]], environment(env)
  if env:
    result = subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600)
  else:
    result = cli_server.run(command, env=full_env, cwd=cwd, timeout=600)
  TIMES.append((time.perf_counter() - start, shlex.join(argv)[:100]))
  return result


def check(where: str, result: subprocess.CompletedProcess) -> str:
  output = result.stdout + result.stderr
  assert result.returncode == 0, f"{where}: exit {result.returncode}\n{output[-3000:]}"
  assert_no_tpu_noise(where, output)
  return output


def assert_no_tpu_noise(where: str, output: str) -> None:
  noise = [n for n in TPU_NOISE if n in output]
  assert not noise, f"{where}: printed TPU runtime messages {noise}\n{output[-2000:]}"


ALL = [c for f in doc_files() for c in commands(f)]


def test_every_command_is_runnable_or_marked():
  bad = [f"{where}: {shlex.join(argv)}" for where, _, argv, _ in ALL if argv[:2] != ["python", "-m"] or not argv[2].startswith("maxtext.")]
  assert not bad, "commands that are not `python -m maxtext.<entry>`; mark their block with <!-- docs-test: skip (reason) -->:\n" + "\n".join(bad)


def test_docs_commands_run(tmp_path):
  (tmp_path / "configs").symlink_to(ROOT / "configs")
  resumed = False
  for where, _, argv, env in ALL:
    entry = argv[2]
    if entry == "maxtext.train" and not any(a in ("-h", "--help") for a in argv):
      output = check(where, run(with_steps(argv, TRAIN_STEPS), env, tmp_path))
      saved = re.search(r"^checkpoint: (/\S+)$", output, re.M)
      assert saved and Path(saved.group(1)).is_dir(), f"{where}: no checkpoint directory reported\n{output[-2000:]}"
      if resumed:
        continue
      resumed = True
      rerun = check(f"{where} (rerun)", run(with_steps(argv, TRAIN_STEPS + 1), env, tmp_path))
      assert f"restored checkpoint at step {TRAIN_STEPS}" in rerun, f"{where}: the rerun did not resume\n{rerun[-2000:]}"
      continue
    output = check(where, run(argv, env, tmp_path))
    if entry == "maxtext.plot" and "--out" in argv:
      assert (tmp_path / argv[argv.index("--out") + 1]).is_file(), f"{where}: no plot written"
    assert output.strip(), f"{where}: printed nothing"
  assert_no_tpu_noise("the server's imports", cli_server.import_output(environment({})))  # what the forked commands skipped
  cli_server.close_all()
  print("\n".join(f"{wall:6.1f}s wall  {cmd}" for wall, cmd in TIMES))


@pytest.mark.parametrize(
  "module", ["train.__main__", "train_compile", "launch.__main__", "config.__main__", "convert.__main__", "tokenizer.__main__", "eval", "plot"]
)
def test_help(module, capsys):
  """-h and --help print usage, the common keys (config entry points) and an example, and exit 0."""
  main = importlib.import_module(f"maxtext.{module}").main
  for flag in ("--help", "-h"):
    try:
      code = main([flag])
    except SystemExit as e:  # argparse-based entry points
      code = e.code
    out = capsys.readouterr().out
    assert code in (0, None), out
    assert "usage:" in out and "example" in out
    if "<config.yml>" in out.splitlines()[0]:
      assert "per_device_batch_size=" in out and "base_output_directory=" in out
