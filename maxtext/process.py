"""Per-process setup that must happen before JAX is asked for devices.

Entry points call `choose_platform()` first thing and pass `prepare` to
`maxtext.config.load(..., before_devices=prepare)`.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import MutableMapping

from maxtext.config import MaxTextConfig

_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def _has_tpu_chips() -> bool:
  from maxtext import distributed

  return distributed._has_tpu_chips()


def _has_cuda() -> bool:
  """A jax CUDA plugin is installed and /dev shows an NVIDIA GPU."""
  return bool(glob.glob("/dev/nvidia[0-9]*")) and any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)


def choose_platform(env: MutableMapping[str, str] | None = None, tpu_chips: bool | None = None, cuda: bool | None = None) -> str | None:
  """On a host without TPU chips, keep JAX off the TPU backend so an installed libtpu neither starts nor logs.

  With JAX_PLATFORMS unset and no TPU chips in /dev, sets JAX_PLATFORMS to 'cuda,cpu' (a GPU and a jax CUDA
  plugin are present) or 'cpu', and returns it; returns None and changes nothing when JAX_PLATFORMS is set or
  TPU chips are present. Must run before JAX initialises a backend (it is safe after `import jax`).
  AOT compilation for TPU topologies does not need the TPU backend (train_compile runs with JAX_PLATFORMS=cpu).
  """
  env = os.environ if env is None else env
  if env.get("JAX_PLATFORMS"):
    return None
  if _has_tpu_chips() if tpu_chips is None else tpu_chips:
    return None
  platforms = "cuda,cpu" if (_has_cuda() if cuda is None else cuda) else "cpu"
  env["JAX_PLATFORMS"] = platforms
  env.setdefault("TPU_STDERR_LOG_LEVEL", "3")  # libtpu stays silent should anything load it (AOT compiles)
  env.setdefault("TPU_MIN_LOG_LEVEL", "3")
  if env is os.environ and "jax" in sys.modules:  # jax read JAX_PLATFORMS at import: update its setting too
    sys.modules["jax"].config.update("jax_platforms", platforms)
  return platforms


def prepare(config: MaxTextConfig) -> None:
  """Pick the platform, tune the host allocator for CPU runs, then join the JAX distributed system if the run spans processes."""
  from maxtext import distributed, host_allocator

  choose_platform()
  host_allocator.tune(config)
  distributed.initialize(config)
