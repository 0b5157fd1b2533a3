"""The `xpk workload create` command that runs maxtext.train on every host of the target slices."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from maxtext.launch.target import Target


def train_command(train_args: Sequence[str]) -> str:
  """The shell command each container runs, quoted so every argument arrives unchanged."""
  return shlex.join(["python", "-m", "maxtext.train", *train_args])


def workload_create(
  target: Target,
  cluster: str,
  workload: str,
  docker_image: str,
  train_args: Sequence[str],
  project: str | None = None,
  zone: str | None = None,
  xpk: str = "xpk",
) -> list[str]:
  cmd = [xpk, "workload", "create", "--cluster", cluster, "--workload", workload, "--tpu-type", target.topo.xpk_tpu_type]
  cmd += ["--num-slices", str(target.num_slices), "--docker-image", docker_image, "--command", train_command(train_args)]
  if project:
    cmd += ["--project", project]
  if zone:
    cmd += ["--zone", zone]
  return cmd
