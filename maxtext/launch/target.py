"""The TPU target of a launch and the config validated for it."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from maxtext import topology
from maxtext.config import MaxTextConfig, load
from maxtext.errors import ConfigError

_SET_BY_LAUNCH = ("compile_topology", "compile_topology_num_slices")
_WORKLOAD_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class Target:
  topo: topology.Topology
  num_slices: int

  @property
  def num_devices(self) -> int:
    return self.topo.chips * self.num_slices


def parse_target(tpu_type: str, num_slices: int) -> Target:
  if num_slices < 1:
    raise ConfigError(f"invalid --num-slices {num_slices}; use a positive integer")
  return Target(topology.parse(tpu_type, what="--tpu-type"), num_slices)


def train_args(config_argv: Sequence[str], config: MaxTextConfig) -> list[str]:
  """The config arguments every host runs with: the user's, with the resolved run_name so all hosts agree on it."""
  return [config_argv[0], *(a for a in config_argv[1:] if a.split("=", 1)[0] != "run_name"), f"run_name={config.run_name}"]


def validate(config_argv: Sequence[str], target: Target) -> MaxTextConfig:
  """The config resolved for the target's devices; a one-line ConfigError when it cannot run there."""
  if not config_argv:
    raise ConfigError("no config given after '--'; usage: python -m maxtext.launch ... -- configs/base.yml run_name=r key=value ...")
  for key in _SET_BY_LAUNCH:
    if any(a.split("=", 1)[0] == key for a in config_argv[1:]):
      raise ConfigError(f"do not set {key} with maxtext.launch; --tpu-type and --num-slices set it")
  # M_<KEY> variables of this shell do not reach the cluster, so the config is resolved without them.
  config = load(config_argv, env={}, num_devices=target.num_devices, num_slices=target.num_slices)
  if config.hardware not in ("auto", "tpu"):
    raise ConfigError(f"hardware={config.hardware} cannot run on TPU slices; use hardware=tpu or auto")
  if config.compile_topology:
    raise ConfigError(f"the config file sets compile_topology={config.compile_topology}; remove it, --tpu-type and --num-slices set the target")
  return config


def workload_name(run_name: str) -> str:
  """A name xpk and Kubernetes accept: lower case letters, digits and '-', starting with a letter, at most 40 characters."""
  name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).lstrip("-0123456789")[:40].rstrip("-")
  return name or "maxtext"


def check_workload_name(name: str) -> str:
  if not _WORKLOAD_NAME.fullmatch(name) or len(name) > 40:
    raise ConfigError(f"invalid --workload '{name}'; use at most 40 lower-case letters, digits and '-', starting with a letter")
  return name
