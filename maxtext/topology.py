"""TPU topology names (v4-8, v5p-128, v5e-16, v6e-256, ...) and their chip facts."""

from __future__ import annotations

import dataclasses
import math
import re

from maxtext.errors import ConfigError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
  generation: str  # 'v4', 'v5p', 'v5e', 'v6e'
  topology_prefix: str  # platform prefix of topology strings, e.g. 'v5'
  chip_config_name: str  # 'megacore' or 'default'
  cores_per_chip_in_name: int  # v4/v5p names count TensorCores (2 per chip)
  hbm_bytes: int
  peak_bf16_tflops: float
  dims: int  # 3 for torus chips (v4, v5p), 2 for v5e/v6e
  xpk_prefix: str  # accelerator name xpk and GKE use, e.g. 'v5litepod' for v5e
  gke_accelerator: str  # GKE node label cloud.google.com/gke-tpu-accelerator


CHIPS = {
  "v4": Chip("v4", "v4", "megacore", 2, 32 * GIB, 275.0, 3, "v4", "tpu-v4-podslice"),
  "v5p": Chip("v5p", "v5", "megacore", 2, 95 * GIB, 459.0, 3, "v5p", "tpu-v5p-slice"),
  "v5e": Chip("v5e", "v5e", "default", 1, 16 * GIB, 197.0, 2, "v5litepod", "tpu-v5-lite-podslice"),
  "v6e": Chip("v6e", "v6e", "default", 1, 32 * GIB, 918.0, 2, "v6e", "tpu-v6e-slice"),
}

# Valid sizes (the number in the name) per generation.
SIZES = {
  "v4": [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
  "v5p": [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
  "v5e": [1, 4, 8, 16, 32, 64, 128, 256],
  "v6e": [1, 4, 8, 16, 32, 64, 128, 256],
}

_2D_SHAPES = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str
  chip: Chip
  chips: int  # chips (= JAX devices) per slice
  shape: tuple[int, ...]  # chip grid

  @property
  def topology_name(self) -> str:
    """Topology string of jax.experimental.topologies, e.g. 'v5:2x2x1'."""
    return f"{self.chip.topology_prefix}:{self.shape_str}"

  @property
  def shape_str(self) -> str:
    """Chip grid as GKE's gke-tpu-topology label writes it, e.g. '2x2x1'."""
    return "x".join(map(str, self.shape))

  @property
  def chips_per_host_bounds(self) -> tuple[int, int, int]:
    """Chip grid of one host VM: 8 chips (2x4) on single-host v5e/v6e-8, one on -1, else 4 (2x2)."""
    if self.chips == 1:
      return (1, 1, 1)
    if self.chip.dims == 2 and self.chips == 8:
      return (2, 4, 1)
    return (2, 2, 1)

  @property
  def chips_per_host(self) -> int:
    return math.prod(self.chips_per_host_bounds)

  @property
  def num_hosts(self) -> int:
    """Host VMs (= processes of a run) per slice."""
    return self.chips // self.chips_per_host

  @property
  def xpk_tpu_type(self) -> str:
    """The --tpu-type xpk expects, e.g. 'v5litepod-16' for v5e-16."""
    return f"{self.chip.xpk_prefix}-{self.name.split('-')[1]}"


_3D_SHAPES = {
  4: (2, 2, 1),
  8: (2, 2, 2),
  16: (2, 2, 4),
  32: (2, 4, 4),
  64: (4, 4, 4),
  128: (4, 4, 8),
  256: (4, 8, 8),
  512: (8, 8, 8),
  1024: (8, 8, 16),
  2048: (8, 16, 16),
  4096: (16, 16, 16),
}


def valid_names() -> list[str]:
  return [f"{gen}-{n}" for gen, sizes in SIZES.items() for n in sizes]


def parse(name: str, what: str = "compile_topology") -> Topology:
  """Topology of a name like 'v5p-128' (xpk's 'v5litepod-16' is accepted for v5e-16); `what` names the setting in errors."""
  m = re.fullmatch(r"(v4|v5p|v5e|v6e|v5litepod)-(\d+)", name.strip())
  generation = "v5e" if m and m.group(1) == "v5litepod" else m and m.group(1)
  if not m or int(m.group(2)) not in SIZES[generation]:
    raise ConfigError(f"unknown {what} '{name}'; valid names: {', '.join(valid_names())}")
  name = f"{generation}-{m.group(2)}"
  chip = CHIPS[generation]
  chips = int(m.group(2)) // chip.cores_per_chip_in_name
  shape = _3D_SHAPES[chips] if chip.dims == 3 else _2D_SHAPES[chips]
  return Topology(name, chip, chips, shape)
