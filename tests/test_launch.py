"""maxtext.launch: config validation for the target, the AOT check, the xpk command (checked with the real xpk), the JobSet."""

import importlib.util
import os
import shlex
import shutil
import subprocess

import pytest
import yaml

from maxtext.launch import __main__ as launch
from maxtext.launch import target

XPK = shutil.which(os.environ.get("XPK", "xpk"))
TINY = [
  "base_emb_dim=64",
  "base_mlp_dim=128",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "head_dim=16",
  "base_num_decoder_layers=2",
  "vocab_size=512",
  "max_target_length=64",
]
TARGET = ["--cluster", "c1", "--tpu-type", "v5p-128", "--num-slices", "2", "--docker-image", "gcr.io/p/maxtext:1", "--project", "p", "--zone", "us-east5-a"]
# an override whose value needs shell quoting must reach maxtext.train unchanged
CONFIG = ["configs/base.yml", "run_name=My_Run.1", "per_device_batch_size=1", "metrics_file=/tmp/it's a file.jsonl", *TINY]


def run(argv, capsys):
  code = 0
  try:
    code = launch.main(argv) or 0
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def train_args_in(text: str) -> list[str]:
  """The argv of `python -m maxtext.train ...` inside a shell command."""
  words = shlex.split(text)
  i = words.index("maxtext.train")
  return words[i + 1 :]


def dry_run_command(capsys, extra=()):
  code, out, err = run([*TARGET, *extra, "--dry-run", "--skip-compile-check", "--", *CONFIG], capsys)
  assert code == 0, err
  return shlex.split(out.strip().splitlines()[-1])


def test_dry_run_prints_the_xpk_command(capsys):
  cmd = dry_run_command(capsys)
  assert os.path.basename(cmd[0]) == "xpk" and cmd[1:3] == ["workload", "create"]
  flags = dict(zip(cmd[3::2], cmd[4::2]))
  assert flags["--tpu-type"] == "v5p-128" and flags["--num-slices"] == "2" and flags["--cluster"] == "c1"
  assert flags["--workload"] == "my-run-1" and flags["--project"] == "p" and flags["--zone"] == "us-east5-a"
  assert flags["--docker-image"] == "gcr.io/p/maxtext:1"
  assert train_args_in(flags["--command"]) == CONFIG[:1] + [a for a in CONFIG[1:] if not a.startswith("run_name=")] + ["run_name=My_Run.1"]


def test_v5e_uses_xpk_accelerator_name_and_empty_run_name_is_fixed_for_all_hosts(capsys):
  code, out, err = run(["--cluster", "c", "--tpu-type", "v5e-16", "--docker-image", "i", "--dry-run", "--skip-compile-check", "--", "configs/base.yml"], capsys)
  assert code == 0, err
  cmd = shlex.split(out.strip().splitlines()[-1])
  flags = dict(zip(cmd[3::2], cmd[4::2]))
  assert flags["--tpu-type"] == "v5litepod-16" and flags["--num-slices"] == "1"
  run_name = [a for a in train_args_in(flags["--command"]) if a.startswith("run_name=")]
  assert len(run_name) == 1 and run_name[0].startswith("run_name=default_")
  assert "note: base_output_directory" in out


@pytest.mark.skipif(XPK is None, reason="xpk not found: install it in a venv of its own and set XPK to its xpk (README.md, Tests), as .ci/run does")
def test_real_xpk_dry_run_shows_topology_slices_and_our_command(capsys, tmp_path):
  cmd = dry_run_command(capsys)
  env = {
    "PATH": os.environ.get("PATH", ""),
    "HOME": str(tmp_path),  # xpk keeps its config under HOME
    "TELEMETRY_ENABLED": "false",
    "DEPENDENCY_AUTO_DOWNLOAD": "false",
  }
  done = subprocess.run([XPK, *cmd[1:], "--dry-run", "--skip-validation"], capture_output=True, text=True, env=env, timeout=60)
  text = done.stdout + done.stderr
  assert done.returncode == 0, text[-2000:]
  assert "cloud.google.com/gke-tpu-accelerator: tpu-v5p-slice" in text
  assert "cloud.google.com/gke-tpu-topology: 4x4x4" in text
  assert "replicas: 2" in text and "parallelism: 16" in text and "google.com/tpu: 4" in text
  train_line = next(line for line in text.splitlines() if "maxtext.train" in line)
  assert train_args_in(train_line.strip().removeprefix("(").split(") & PID")[0]) == train_args_in(dict(zip(cmd[3::2], cmd[4::2]))["--command"])


def test_output_manifest_is_a_jobset_matching_the_target(capsys, tmp_path):
  path = tmp_path / "jobset.yaml"
  code, out, err = run([*TARGET, "--skip-compile-check", "--output-manifest", str(path), "--", *CONFIG], capsys)
  assert code == 0, err
  assert f"kubectl apply -f {path}" in out
  doc = yaml.safe_load(path.read_text())
  assert doc["kind"] == "JobSet" and doc["metadata"]["name"] == "my-run-1"
  (rj,) = doc["spec"]["replicatedJobs"]
  job = rj["template"]["spec"]
  pod = job["template"]["spec"]
  assert rj["replicas"] == 2 and job["parallelism"] == job["completions"] == 16
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": "4x4x4"}
  (container,) = pod["containers"]
  assert container["image"] == "gcr.io/p/maxtext:1" and container["resources"]["limits"]["google.com/tpu"] == 4
  assert container["command"][:3] == ["python", "-m", "maxtext.train"] and "metrics_file=/tmp/it's a file.jsonl" in container["command"]


@pytest.mark.parametrize(
  "argv, message",
  [
    ([*TARGET, "--", *CONFIG, "ici_fsdp_parallelism=3"], "ici parallelism"),
    ([*TARGET, "--", *CONFIG, "compile_topology=v5p-8"], "do not set compile_topology with maxtext.launch"),
    ([*TARGET, "--", *CONFIG, "hardware=cpu"], "hardware=cpu cannot run on TPU slices"),
    (["--cluster", "c", "--tpu-type", "v7-8", "--docker-image", "i", "--", *CONFIG], "unknown --tpu-type 'v7-8'; valid names"),
    ([*TARGET, *CONFIG], "missing '--' before the config"),
    ([*TARGET, "--workload", "Bad_Name", "--", *CONFIG], "invalid --workload 'Bad_Name'"),
    ([*TARGET, "--"], "no config given after '--'"),
  ],
)
def test_user_errors_exit_2_with_one_line(argv, message, capsys):
  code, out, err = run(["--dry-run", *argv], capsys)
  assert code == 2
  (line,) = err.strip().splitlines()
  assert line.startswith("error: ") and message in line


def test_workload_names():
  assert target.workload_name("llama3.1-8b_2025-01-02-03-04") == "llama3-1-8b-2025-01-02-03-04"
  assert target.workload_name("0_run") == "run"
  assert target.workload_name("__") == "maxtext"
  assert len(target.workload_name("x" * 80)) == 40


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")


@needs_libtpu
def test_compile_check_runs_first_and_passes(capsys):
  code, out, err = run(["--cluster", "c", "--tpu-type", "v5e-4", "--docker-image", "i", "--dry-run", "--", *CONFIG], capsys)
  assert code == 0, err
  assert "AOT check: fits" in out and "xpk workload create" in out.strip().splitlines()[-1]


@needs_libtpu
def test_job_that_does_not_fit_stops_before_submitting(capsys):
  big = [a for a in CONFIG if not a.startswith(("vocab_size", "max_target_length", "per_device_batch_size"))]
  big += ["vocab_size=32000", "max_target_length=8192", "per_device_batch_size=64"]
  code, out, err = run(["--cluster", "c", "--tpu-type", "v5e-4", "--docker-image", "i", "--dry-run", "--", *big], capsys)
  assert code == 3
  assert "xpk workload create" not in out
  (line,) = err.strip().splitlines()
  assert line.startswith("error: does not fit: needs ") and "v5e has 16.00 GiB" in line
