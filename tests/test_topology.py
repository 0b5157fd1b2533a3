"""TPU topology names, and the compile-only devices libtpu builds for each of them."""

import importlib.util

import pytest

from maxtext import mesh, topology
from maxtext.config import ConfigError, from_overrides

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install 'maxtext[tpu]')")


@pytest.mark.parametrize(
  "name, chips, topology_name, hosts, xpk",
  [
    ("v4-8", 4, "v4:2x2x1", 1, "v4-8"),
    ("v4-16", 8, "v4:2x2x2", 2, "v4-16"),
    ("v4-128", 64, "v4:4x4x4", 16, "v4-128"),
    ("v5p-8", 4, "v5:2x2x1", 1, "v5p-8"),
    ("v5p-128", 64, "v5:4x4x4", 16, "v5p-128"),
    ("v5p-1024", 512, "v5:8x8x8", 128, "v5p-1024"),
    ("v5e-1", 1, "v5e:1x1", 1, "v5litepod-1"),
    ("v5e-4", 4, "v5e:2x2", 1, "v5litepod-4"),
    ("v5e-8", 8, "v5e:2x4", 1, "v5litepod-8"),
    ("v5e-16", 16, "v5e:4x4", 4, "v5litepod-16"),
    ("v5e-256", 256, "v5e:16x16", 64, "v5litepod-256"),
    ("v6e-8", 8, "v6e:2x4", 1, "v6e-8"),
    ("v6e-64", 64, "v6e:8x8", 16, "v6e-64"),
    ("v6e-256", 256, "v6e:16x16", 64, "v6e-256"),
  ],
)
def test_names_match_the_reference_table(name, chips, topology_name, hosts, xpk):
  t = topology.parse(name)
  assert (t.chips, t.topology_name, t.num_hosts, t.xpk_tpu_type) == (chips, topology_name, hosts, xpk)


def test_xpk_name_is_accepted_and_unknown_names_list_the_valid_ones():
  assert topology.parse("v5litepod-16").name == "v5e-16"
  with pytest.raises(ConfigError, match=r"unknown --tpu-type 'v7-8'; valid names: v4-8, .*v5p-128, .*v5e-16, .*v6e-256") as e:
    topology.parse("v7-8", what="--tpu-type")
  assert "\n" not in str(e.value)
  for bad in ("v5p-12", "v6e-512", "v5p8", ""):
    with pytest.raises(ConfigError):
      topology.parse(bad)


@needs_libtpu
def test_every_name_builds_its_devices():
  from maxtext.aot.devices import topology_devices

  kinds = {"v4": "TPU v4", "v5p": "TPU v5", "v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}
  for name in topology.valid_names():
    t = topology.parse(name)
    devices = topology_devices(t)
    assert len(devices) == t.chips, name
    assert devices[0].device_kind == kinds[t.chip.generation], name


@needs_libtpu
@pytest.mark.parametrize("name", ["v5p-8", "v5e-16", "v6e-8"])
def test_two_slices_form_a_hybrid_mesh_with_dcn_data_parallelism(name):
  from maxtext.aot.devices import topology_devices

  t = topology.parse(name)
  config = from_overrides(compile_topology=name, compile_topology_num_slices=2)
  devices = topology_devices(t, 2)
  assert len(devices) == 2 * t.chips and {d.slice_index for d in devices} == {0, 1}
  m = mesh.create(config, devices=devices)
  assert dict(m.shape)["data"] == 2 and dict(m.shape)["fsdp"] == t.chips
  # each slice's devices sit on one side of the data (dcn) axis
  for i in range(2):
    assert {d.slice_index for d in m.devices[i].flat} == {i}
