"""tests/cli_server.py: a command forked from the warm server ends as the same command run as a new process does."""

import subprocess

from tests import cli_server
from tests.test_bad_inputs import _env, _train


def test_a_forked_command_matches_a_new_process(tmp_path):
  (tmp_path / "a_file").write_text("x")
  argv = _train(f"base_output_directory={tmp_path}/a_file/out", "quantization=int8")
  forked = cli_server.run(argv, env=_env(), cwd=tmp_path, timeout=180)
  real = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=180)
  assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
  assert forked.returncode == 2 and forked.stderr.startswith("error: ") and "not a directory" in forked.stderr
