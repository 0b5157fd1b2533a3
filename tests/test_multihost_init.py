"""When and how maxtext joins the JAX distributed system (detection reads only env vars and /dev)."""

import pytest

from maxtext import distributed
from maxtext.config import ConfigError, from_overrides

BASE = from_overrides(num_devices=1)


def cfg(**kw):
  return BASE.model_copy(update=kw)


@pytest.mark.parametrize(
  "overrides, env, tpu_chips, mode",
  [
    ({}, {}, False, "skip"),  # a laptop
    ({"skip_jax_distributed_system": True}, {"TPU_WORKER_HOSTNAMES": "a,b"}, True, "skip"),
    ({"jax_coordinator_address": "10.0.0.1:1234", "jax_num_processes": 2}, {}, False, "explicit"),
    ({"jax_coordinator_address": "10.0.0.1:1234", "jax_num_processes": 1}, {}, False, "skip"),
    ({"jax_coordinator_address": "10.0.0.1:1234"}, {}, False, "explicit"),  # counts from the cluster env
    ({}, {"TPU_WORKER_HOSTNAMES": "host-0,host-1", "TPU_WORKER_ID": "1"}, True, "auto"),  # GKE JobSet, several hosts
    ({}, {"TPU_WORKER_HOSTNAMES": "host-0"}, True, "skip"),  # GKE JobSet, one host
    ({}, {"TPU_WORKER_HOSTNAMES": "host-0", "MEGASCALE_NUM_SLICES": "2"}, True, "auto"),  # one host per slice, 2 slices
    ({}, {}, True, "auto"),  # TPU VM: the metadata server knows the workers
    ({"hardware": "cpu"}, {}, True, "skip"),
    ({}, {"JAX_PLATFORMS": "cpu"}, True, "skip"),  # a TPU VM's host CPU
    ({"hardware": "gpu_multiprocess"}, {}, False, "auto"),
    ({}, {"SLURM_NTASKS": "4"}, False, "auto"),
    ({}, {"SLURM_NTASKS": "1"}, False, "skip"),
  ],
)
def test_detect(overrides, env, tpu_chips, mode):
  assert distributed.detect(cfg(**overrides), env=env, tpu_chips=tpu_chips) == mode


def test_single_process_run_is_a_noop_and_never_initialises(monkeypatch):
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(distributed.platform, "has_tpu_chips", lambda: False)
  for key in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "MEGASCALE_NUM_SLICES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(key, raising=False)
  distributed.initialize(cfg())
  distributed.initialize(cfg(jax_coordinator_address="127.0.0.1:1", jax_num_processes=1))
  assert calls == []


def test_explicit_settings_are_passed_and_errors_are_one_line(monkeypatch):
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  c = cfg(jax_coordinator_address="10.0.0.1:1234", jax_num_processes=4, jax_process_id=3, jax_distributed_initialization_timeout=7)
  distributed.initialize(c)
  assert calls == [(("10.0.0.1:1234",), {"num_processes": 4, "process_id": 3, "initialization_timeout": 7})]

  with pytest.raises(ConfigError, match="host:port"):
    distributed.initialize(cfg(jax_coordinator_address="10.0.0.1", jax_num_processes=2))
  with pytest.raises(ConfigError, match="jax_process_id 2 is not below jax_num_processes 2"):
    distributed.initialize(cfg(jax_coordinator_address="10.0.0.1:1", jax_num_processes=2, jax_process_id=2))

  def refuse(*a, **k):
    raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out\nmore detail")

  monkeypatch.setattr(distributed.jax.distributed, "initialize", refuse)
  with pytest.raises(ConfigError, match=r"could not join the JAX distributed system at 10.0.0.1:1 within 300s \(DEADLINE_EXCEEDED") as e:
    distributed.initialize(cfg(jax_coordinator_address="10.0.0.1:1", jax_num_processes=2))
  assert "\n" not in str(e.value)


def test_already_initialised_is_left_alone(monkeypatch):
  monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *a, **k: pytest.fail("initialised twice"))
  distributed.initialize(cfg(jax_coordinator_address="10.0.0.1:1234", jax_num_processes=2))
