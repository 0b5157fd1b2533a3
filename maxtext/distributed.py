"""Join the JAX distributed system before JAX is asked for devices (multi-host TPU, GKE, Slurm, explicit coordinator).

`initialize(config)` runs in `maxtext.process.prepare`, which entry points pass to `maxtext.config.load(..., devices=prepare)`.
Detection reads only environment variables and /dev, so a plain single-process run never
blocks on a network lookup.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

from maxtext import platform
from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError

# Environment variables set by launchers that start several processes, with what makes them multi-process.
_TPU_HOST_LISTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")  # GKE TPU pods (JobSet), comma-separated hosts
_COUNT_VARS = ("MEGASCALE_NUM_SLICES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _count(value: str | None) -> int:
  try:
    return int(value) if value else 1
  except ValueError:
    return 1


def detect(config: MaxTextConfig, env: Mapping[str, str] | None = None, tpu_chips: bool | None = None) -> str:
  """How this run joins the distributed system: 'skip', 'explicit' or 'auto'."""
  env = os.environ if env is None else env
  if config.skip_jax_distributed_system:
    return "skip"
  if config.jax_coordinator_address:
    return "skip" if config.jax_num_processes == 1 else "explicit"
  hosts = next((env[k] for k in _TPU_HOST_LISTS if env.get(k)), "")
  if len([h for h in hosts.split(",") if h.strip()]) > 1 or any(_count(env.get(k)) > 1 for k in _COUNT_VARS):
    return "auto"
  if config.hardware == "gpu_multiprocess":
    return "auto"
  if hosts:  # one TPU host listed: a single-process job
    return "skip"
  # A TPU VM running on its chips without host lists is one worker of a slice; the metadata server says how many.
  on_tpu_vm = platform.has_tpu_chips() if tpu_chips is None else tpu_chips
  return "auto" if on_tpu_vm and platform.predict(config, env.get("JAX_PLATFORMS", ""), on_tpu_vm) == "tpu" else "skip"


def initialize(config: MaxTextConfig) -> None:
  """Initialise jax.distributed when the run spans several processes; a no-op otherwise or when already done."""
  if jax.distributed.is_initialized():
    return
  mode = detect(config)
  if mode == "skip":
    return
  timeout = config.jax_distributed_initialization_timeout
  if mode == "auto":
    jax.distributed.initialize(initialization_timeout=timeout)
    return
  address = config.jax_coordinator_address
  if ":" not in address:
    raise ConfigError(f"invalid value for 'jax_coordinator_address': {address!r}; use host:port of process 0, e.g. 10.0.0.1:1234")
  processes = config.jax_num_processes or None
  process_id = config.jax_process_id if config.jax_process_id >= 0 else None
  if processes is not None and process_id is not None and process_id >= processes:
    raise ConfigError(f"jax_process_id {process_id} is not below jax_num_processes {processes}; number processes 0..{processes - 1}")
  try:
    jax.distributed.initialize(address, num_processes=processes, process_id=process_id, initialization_timeout=timeout)
  except (RuntimeError, ValueError) as e:
    if "must be called before" in str(e):
      raise
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(
      f"could not join the JAX distributed system at {address} within {timeout}s ({first}); "
      "start every process with the same jax_coordinator_address and jax_num_processes and a distinct jax_process_id"
    ) from None


def all_processes_agree(flag: bool) -> bool:
  """True when flag holds on every process (a host sync; only for rare decisions such as the end of eval or which checkpoint to restore)."""
  if jax.process_count() == 1:
    return flag
  import numpy as np
  from jax.experimental import multihost_utils

  return bool(np.all(multihost_utils.process_allgather(np.asarray(flag))))
