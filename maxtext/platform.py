"""The target platform, resolved once during setup, and the kernels-and-numerics policy that layers receive.

`resolve(config, mesh)` reads the platform from the mesh's devices, so an AOT compile for a TPU topology on a
CPU host gets the TPU policy. `predict(config)` answers the same question before JAX starts (host allocator,
distributed setup), from `hardware`, `JAX_PLATFORMS` and the accelerator device nodes. Layers take a `Policy`
in their constructor and never ask JAX which backend they run on; the CPU test suite builds models with the
GPU or TPU policy (`for_platform(config, "tpu", interpret=True)`) to run those code paths.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import sys
from collections.abc import Iterable, MutableMapping

import jax

from maxtext.config import MaxTextConfig
from maxtext.layers import quantization

PLATFORMS = ("cpu", "gpu", "tpu")
_TPU_NODES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")  # v2-v4 expose /dev/accel*, v5e/v5p/v6e /dev/vfio/<n>
_GPU_NODES = ("/dev/nvidia[0-9]*",)
_HARDWARE_PLATFORM = {"cpu": "cpu", "gpu": "gpu", "gpu_multiprocess": "gpu", "tpu": "tpu"}

# CPU: sequences at least this long take the chunked O(S)-memory attention under attention=autoselected.
CPU_CHUNKED_ATTENTION_FROM = 2048
CPU_ATTENTION_KEY_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
  """Block sizes of TPU splash attention (MaxText's sa_* keys); clipped to the sequence length at trace time."""

  block_q: int = 512
  block_kv: int = 512
  block_kv_compute: int = 512
  block_q_dkv: int = 512
  block_kv_dkv: int = 512
  block_kv_dkv_compute: int = 512
  block_q_dq: int = 512
  block_kv_dq: int = 512
  use_fused_bwd_kernel: bool = False


@dataclasses.dataclass(frozen=True)
class Policy:
  """What differs per platform: the attention kernel, numerics tricks and host setup. Hashable (it sits in graphdefs)."""

  platform: str  # 'cpu' | 'gpu' | 'tpu': the platform the traced code compiles for
  attention: str = "autoselected"  # config.attention: autoselected | dot_product | flash | cudnn
  integer_bf16_rounding: bool = False  # float32 -> bfloat16 casts by integer ops (XLA:CPU's fused convert is slow)
  tune_host_allocator: bool = False  # keep large host buffers mapped between steps (maxtext.host_allocator)
  interpret_kernels: bool = False  # run Pallas kernels in interpret mode (accelerator policies tested on CPU)
  splash: SplashBlocks = SplashBlocks()
  chunked_attention_from: int = 0  # sequences at least this long take the chunked XLA path (0 = never)
  attention_key_block: int = CPU_ATTENTION_KEY_BLOCK  # keys per step of the chunked path
  max_segments_per_seq: int = -1  # documents per packed row (data pipeline bound); > 0 enables cuDNN packed offsets
  unstacked_decode: bool = False  # decode with per-layer arrays: XLA:CPU copies a scan's slices of stacked weights and caches
  compiler_state_layouts: bool = False  # XLA picks the train state's device layouts (TPU: no per-step relayout of stacked kernels)
  offload_layer_inputs: bool = False  # keep each decoder layer's saved input in pinned host memory (config.decoder_layer_input)
  quantization: quantization.Recipe | None = None  # config.quantization's matmul recipe (qwix); its `native` says whether this platform's units take it


def splash_blocks(config: MaxTextConfig) -> SplashBlocks:
  c = config
  return SplashBlocks(
    c.sa_block_q,
    c.sa_block_kv,
    c.sa_block_kv_compute,
    c.sa_block_q_dkv,
    c.sa_block_kv_dkv,
    c.sa_block_kv_dkv_compute,
    c.sa_block_q_dq,
    c.sa_block_kv_dq,
    c.sa_use_fused_bwd_kernel,
  )


def for_platform(config: MaxTextConfig, platform: str, interpret: bool = False) -> Policy:
  """The policy for running config on platform; interpret=True runs Pallas kernels in interpret mode (CPU tests)."""
  if platform not in PLATFORMS:
    raise ValueError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")
  cpu = platform == "cpu"
  return Policy(
    platform=platform,
    attention=config.attention,
    integer_bf16_rounding=cpu,
    tune_host_allocator=cpu,
    interpret_kernels=interpret,
    splash=splash_blocks(config),
    chunked_attention_from=CPU_CHUNKED_ATTENTION_FROM if cpu else 0,
    max_segments_per_seq=config.max_segments_per_seq,
    unstacked_decode=cpu,
    compiler_state_layouts=platform == "tpu",
    offload_layer_inputs=offload_layer_inputs(config, platform),
    quantization=quantization.recipe(config, native=native_format(config.quantization, platform)),
  )


# Matmul formats the platform's units take natively, per mode (else XLA converts them to bf16: same numerics, no speedup).
# TPU v4-v6e and NVIDIA GPUs multiply int8 with int32 accumulation; fp8 needs NVIDIA sm_89+ (checked in `check_devices`);
# XLA:CPU runs int8 dots as integer dots and converts fp8 to float.
NATIVE_FORMATS = {"cpu": ("int8",), "gpu": ("int8", "fp8", "fp8_full"), "tpu": ("int8",)}


def native_format(mode: str, platform: str) -> bool:
  return mode in NATIVE_FORMATS[platform]


def offload_layer_inputs(config: MaxTextConfig, platform: str) -> bool:
  """decoder_layer_input: offload, or auto on TPU with scanned layers (there the scanned loop keeps a [layers, B, S, E]
  stack of inputs in HBM; unrolled TPU layers measured no better offloaded, benchmarks/README.md)."""
  where = config.decoder_layer_input
  return where == "offload" or (where == "auto" and platform == "tpu" and config.scan_layers)


def platform_of(devices: Iterable[jax.Device]) -> str:
  """The one platform of devices ('cpu', 'gpu' or 'tpu'); CUDA/ROCm devices count as 'gpu'."""
  platforms = {"gpu" if d.platform in ("cuda", "rocm") else d.platform for d in devices}
  if len(platforms) != 1:
    raise ValueError(f"devices span platforms {sorted(platforms)}; a mesh must use one")
  return platforms.pop()


def resolve(config: MaxTextConfig, mesh: jax.sharding.Mesh | None = None) -> Policy:
  """The policy for the mesh's devices (a TPU topology under AOT), else for JAX's local devices."""
  devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()
  policy = for_platform(config, platform_of(devices))
  quantization.check_devices(policy.quantization, devices)
  return policy


def has_tpu_chips() -> bool:
  """TPU VMs expose their chips as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e, v5p, v6e)."""
  return any(glob.glob(pattern) for pattern in _TPU_NODES)


def has_gpus() -> bool:
  return any(glob.glob(pattern) for pattern in _GPU_NODES)


def predict(config: MaxTextConfig, platforms: str | None = None, accelerator_nodes: bool | None = None) -> str:
  """The platform JAX will pick, decided without initialising it: hardware, else the first of JAX_PLATFORMS,
  else 'tpu'/'gpu' when /dev shows TPU chips or GPUs, else 'cpu'.

  platforms defaults to JAX's `jax_platforms` setting; accelerator_nodes (tests) says whether /dev shows accelerators.
  """
  if config.hardware != "auto":
    return _HARDWARE_PLATFORM[config.hardware]
  first = (jax.config.jax_platforms or "" if platforms is None else platforms).split(",")[0].strip()
  if first:
    return "gpu" if first in ("cuda", "rocm") else first
  if accelerator_nodes is not None:
    return "tpu" if accelerator_nodes else "cpu"
  return "tpu" if has_tpu_chips() else "gpu" if has_gpus() else "cpu"


def local_platform() -> str:
  """The platform of this process's devices (what perf measurements run on)."""
  return platform_of(jax.local_devices())


_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def _has_cuda() -> bool:
  """A jax CUDA plugin is installed and /dev shows an NVIDIA GPU."""
  return has_gpus() and any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)


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
  if has_tpu_chips() if tpu_chips is None else tpu_chips:
    return None
  platforms = "cuda,cpu" if (_has_cuda() if cuda is None else cuda) else "cpu"
  env["JAX_PLATFORMS"] = platforms
  env.setdefault("TPU_STDERR_LOG_LEVEL", "3")  # libtpu stays silent should anything load it (AOT compiles)
  env.setdefault("TPU_MIN_LOG_LEVEL", "3")
  if env is os.environ and "jax" in sys.modules:  # jax read JAX_PLATFORMS at import: update its setting too
    sys.modules["jax"].config.update("jax_platforms", platforms)
  return platforms
