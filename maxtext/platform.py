"""The target platform, resolved once during setup, and the kernels-and-numerics policy that layers receive.

Every question about devices and backends is answered here. `resolve(config, mesh)` reads the platform from the
mesh's devices, so an AOT compile for a TPU topology on a CPU host gets the TPU policy. `predict(config)` answers
the same question before JAX starts (host allocator, distributed setup), from `hardware`, `JAX_PLATFORMS` and the
accelerator device nodes, and `device_counts` counts devices for the config without starting JAX unless asked.
Layers take a `Policy` in their constructor and never ask JAX which backend they run on; the CPU test suite
builds models with the GPU or TPU policy (`for_platform(config, "tpu", interpret=True)`) to run those code paths.

This module sits below maxtext.config (loading a config asks it for the device counts), so it reads the few
config keys it needs through `PolicyKeys` instead of importing the config class.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

import ml_dtypes
import numpy as np

from maxtext.errors import ConfigError
from maxtext.quantization_recipe import Recipe, check_devices, recipe

if TYPE_CHECKING:
  import jax  # imported where devices are read: `import maxtext` chooses the platform without importing JAX


PLATFORMS = ("cpu", "gpu", "tpu")
_TPU_NODES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")  # v2-v4 expose /dev/accel*, v5e/v5p/v6e /dev/vfio/<n>
_GPU_NODES = ("/dev/nvidia[0-9]*",)
_HARDWARE_PLATFORM = {"cpu": "cpu", "gpu": "gpu", "gpu_multiprocess": "gpu", "tpu": "tpu"}  # config.hardware -> platform
# DeepSeek Sparse Attention in training, per block of 128 queries (maxtext.layers.mla_sparse): gather (each query's
# top-k latent keys, attended in MLA's absorbed form) or masked (XLA attention over every key, masked to the top-k).
# TPU AOT, deepseek3.2-671b's attention shapes on v5p-256 at 4096 tokens (docs/tpu.md): gather 9.67 GiB of temporaries
# per device, masked 10.91 GiB, the dense masked form 34.00 GiB. GPU and CPU: gather too (indexer_topk keys per query, not S).
SPARSE_ATTENTION = {"tpu": "gather", "gpu": "gather", "cpu": "gather"}
FUSED_ATTENTION = {"tpu": "splash", "gpu": "cudnn", "cpu": "chunked"}  # each platform's fused attention kernel

# CPU: sequences at least this long take the chunked O(S)-memory attention under attention=autoselected.
CPU_CHUNKED_ATTENTION_FROM = 2048
CPU_ATTENTION_KEY_BLOCK = 512

MOE_DISPATCHES = ("megablox", "tokamax", "ragged_dot", "dense")


@dataclasses.dataclass(frozen=True)
class MoEDefault:
  """What MaxText's default keys (sparse_matmul=true, megablox=true) run on one platform, by shape class: the shape
  class is num_experts / num_experts_per_tok, the FLOPs multiple of computing every expert for every token."""

  grouped: str  # the grouped-matmul path: megablox (TPU Pallas kernel) | ragged_dot
  dense_up_to: float = 0.0  # run the dense dispatch instead when num_experts / num_experts_per_tok <= this


MOE_DEFAULTS = {
  # TPU: the Pallas grouped matmul (MaxText's default); dense dispatch spends E/k times the FLOPs and [E, T] buffers.
  "tpu": MoEDefault("megablox"),
  # GPU: dense where it costs at most 4x the routed FLOPs, ragged_dot beyond. Mixtral-shaped step (8 experts, top 2;
  # benchmarks/README.md, GPU suite): H200, dropless: dense 0.440 s, ragged_dot 0.669 s (H100 before: 0.443, 0.700 s);
  # tokamax's grouped matmul is measured by the suite's next run.
  "gpu": MoEDefault("ragged_dot", dense_up_to=4.0),
  # CPU: measured with benchmarks/moe_paths.py (benchmarks/README.md, "The dispatch paths on CPU": dense fastest at 8 experts, top 2).
  "cpu": MoEDefault("ragged_dot", dense_up_to=4.0),
}
TOKAMAX_IMPLEMENTATION = {"tpu": "mosaic_tpu", "gpu": None, "cpu": "xla"}  # tokamax on CPU has only its XLA path


class PolicyKeys(Protocol):
  """The config keys this module reads (maxtext.config.MaxTextConfig has them), besides splash_blocks' sa_* keys."""

  hardware: str
  attention: str
  max_segments_per_seq: int
  decoder_layer_input: str
  optimizer_memory_host_offload: bool
  quantization: str  # with the keys maxtext.quantization_recipe.recipe reads when it is set
  sparse_matmul: bool
  megablox: bool
  use_tokamax_gmm: bool
  num_experts: int
  num_experts_per_tok: int
  dtype: str
  weight_dtype: str
  matmul_precision: str


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


DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}  # config name -> dtype


@dataclasses.dataclass(frozen=True)
class Dtypes:
  """The model's numeric types, resolved once from the config's names (`resolve_dtypes`): the one place a dtype name becomes a dtype."""

  params: np.dtype = DTYPES["float32"]  # weight_dtype: how parameters are stored
  compute: np.dtype = DTYPES["bfloat16"]  # dtype: activations and matmul operands
  accumulation: np.dtype = DTYPES["float32"]  # norms, softmax, routing, rotary and mHC mixing; matmuls accumulate in it
  output: np.dtype = DTYPES["float32"]  # the logits the model returns
  precision: Any = None  # matmul_precision as a jax.lax.Precision (None: XLA's default)


def resolve_dtypes(config: PolicyKeys) -> Dtypes:
  """The config's dtype, weight_dtype and matmul_precision names as types."""
  import jax  # the policy is resolved when a model is built, after JAX started

  precisions = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH, "highest": jax.lax.Precision.HIGHEST}
  return Dtypes(params=DTYPES[config.weight_dtype], compute=DTYPES[config.dtype], precision=precisions[config.matmul_precision])


@dataclasses.dataclass(frozen=True)
class Policy:
  """What differs per platform: the attention kernel, numerics tricks and host setup. Hashable (it sits in graphdefs)."""

  platform: str  # 'cpu' | 'gpu' | 'tpu': the platform the traced code compiles for
  attention: str = "autoselected"  # config.attention: autoselected | dot_product | flash | cudnn
  fused_attention: str = "chunked"  # the platform's fused kernel, for attention=flash and autoselected: splash | cudnn | chunked
  integer_bf16_rounding: bool = False  # float32 -> bfloat16 casts by integer ops (XLA:CPU's fused convert is slow)
  tune_host_allocator: bool = False  # keep large host buffers mapped between steps (maxtext.host_allocator)
  interpret_kernels: bool = False  # run Pallas kernels in interpret mode (accelerator policies tested on CPU)
  splash: SplashBlocks = SplashBlocks()  # block sizes of TPU splash attention (the sa_* keys)
  chunked_attention_from: int = 0  # sequences at least this long take the chunked XLA path (0 = never)
  attention_key_block: int = CPU_ATTENTION_KEY_BLOCK  # keys per step of the chunked path
  max_segments_per_seq: int = -1  # documents per packed row (data pipeline bound); > 0 enables cuDNN packed offsets
  unstacked_decode: bool = False  # decode with per-layer arrays: XLA:CPU copies a scan's slices of stacked weights and caches
  compiler_state_layouts: bool = False  # XLA picks the train state's device layouts (TPU: no per-step relayout of stacked kernels; not with host-held state, which XLA's TPU layout assignment rejects)
  offload_layer_inputs: bool = False  # keep each decoder layer's saved input in pinned host memory (decoder_layer_input=offload)
  host_offload: bool = False  # pinned host memory may hold activations: decoder_layer_input=auto tries it when HBM is short (TPU)
  quantization: Recipe | None = None  # config.quantization's matmul recipe (qwix); its `native` says whether this platform's units take it
  moe_dispatch: str = "ragged_dot"  # how MoE layers run their experts: megablox | tokamax | ragged_dot | dense (moe_dispatch())
  tokamax_implementation: str | None = None  # use_tokamax_gmm: tokamax's ragged_dot implementation; None lets tokamax choose
  ragged_all_to_all: bool = True  # expert-parallel dropless exchange by ragged_all_to_all (XLA:CPU lacks it: a padded all_to_all)
  dtypes: Dtypes = Dtypes()  # the model's parameter, compute, accumulation and output dtypes and matmul precision
  sparse_attention: str = "gather"  # DeepSeek Sparse Attention's training path (SPARSE_ATTENTION): gather | masked


def splash_blocks(config: PolicyKeys) -> SplashBlocks:
  """The sa_<field> keys of the config (MaxText's splash attention block sizes)."""
  return SplashBlocks(*(getattr(config, f"sa_{field.name}") for field in dataclasses.fields(SplashBlocks)))


def for_platform(config: PolicyKeys, platform: str, interpret: bool = False) -> Policy:
  """The policy for running config on platform; interpret=True runs Pallas kernels in interpret mode (CPU tests)."""
  if platform not in PLATFORMS:
    raise ValueError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")
  cpu = platform == "cpu"
  return Policy(
    platform=platform,
    attention=config.attention,
    fused_attention=FUSED_ATTENTION[platform],
    integer_bf16_rounding=cpu,
    tune_host_allocator=cpu,
    interpret_kernels=interpret,
    splash=splash_blocks(config),
    chunked_attention_from=CPU_CHUNKED_ATTENTION_FROM if cpu else 0,
    max_segments_per_seq=config.max_segments_per_seq,
    unstacked_decode=cpu,
    compiler_state_layouts=platform == "tpu" and not config.optimizer_memory_host_offload,
    offload_layer_inputs=config.decoder_layer_input == "offload",  # auto is resolved by compiling (maxtext.aot.remat_auto)
    host_offload=platform == "tpu",
    quantization=_quantization_recipe(config, platform),
    moe_dispatch=moe_dispatch(config, platform),
    tokamax_implementation=TOKAMAX_IMPLEMENTATION[platform],
    ragged_all_to_all=not cpu,
    dtypes=resolve_dtypes(config),
    sparse_attention=SPARSE_ATTENTION[platform],
  )


# Matmul formats the platform's units take natively, per mode (else XLA converts them to bf16: same numerics, no speedup).
# TPU v4-v6e and NVIDIA GPUs multiply int8 with int32 accumulation; fp8 needs NVIDIA sm_89+ (checked in `resolve`);
# XLA:CPU runs int8 dots as integer dots and converts fp8 to float.
NATIVE_FORMATS = {"cpu": ("int8",), "gpu": ("int8", "fp8", "fp8_full"), "tpu": ("int8",)}


def _quantization_recipe(config: PolicyKeys, platform: str) -> Recipe | None:
  if not config.quantization:
    return None
  return recipe(config, native=config.quantization in NATIVE_FORMATS[platform])


def moe_dispatch(config: PolicyKeys, platform: str) -> str:
  """MaxText's keys pick the path: sparse_matmul=false -> dense; megablox=false -> ragged_dot; use_tokamax_gmm ->
  tokamax. MaxText's defaults (both true) pick this platform's measured choice (MOE_DEFAULTS), by shape class.
  With `quantization`, megablox and tokamax become ragged_dot: their kernels take no quantized operands (XLA's
  ragged dot on the quantized operands, maxtext.layers.quantization.ragged_dot; the train banner says so)."""
  path = keyed_moe_dispatch(config, platform)
  return "ragged_dot" if config.quantization and path in ("megablox", "tokamax") else path


def keyed_moe_dispatch(config: PolicyKeys, platform: str) -> str:
  """The path MaxText's MoE keys pick on platform, before `quantization` is considered (moe_dispatch)."""
  c = config
  if not c.sparse_matmul:
    return "dense"
  if not c.megablox:
    return "ragged_dot"
  if c.use_tokamax_gmm:
    return "tokamax"
  default = MOE_DEFAULTS[platform]
  if c.num_experts > 1 and c.num_experts / c.num_experts_per_tok <= default.dense_up_to:
    return "dense"
  return default.grouped


def platform_of(devices: Iterable[jax.Device]) -> str:
  """The one platform of devices ('cpu', 'gpu' or 'tpu'); CUDA/ROCm devices count as 'gpu'."""
  platforms = {"gpu" if d.platform in ("cuda", "rocm") else d.platform for d in devices}
  if len(platforms) != 1:
    raise ValueError(f"devices span platforms {sorted(platforms)}; a mesh must use one")
  return platforms.pop()


def resolve(config: PolicyKeys, mesh: jax.sharding.Mesh | None = None) -> Policy:
  """The policy for the mesh's devices (a TPU topology under AOT), else for JAX's local devices."""
  import jax

  devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()
  policy = for_platform(config, platform_of(devices))
  if policy.quantization is not None:
    check_devices(policy.quantization, devices)
  return policy


def _nodes(patterns: Iterable[str]) -> list[str]:
  return [path for pattern in patterns for path in glob.glob(pattern)]


def has_tpu_chips() -> bool:
  """TPU VMs expose their chips as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e, v5p, v6e)."""
  return bool(_nodes(_TPU_NODES))


def has_gpus() -> bool:
  return bool(_nodes(_GPU_NODES))


def predict(config: PolicyKeys, platforms: str | None = None, accelerator_nodes: bool | None = None) -> str:
  """The platform JAX will pick, decided without initialising it: hardware, else the first of JAX_PLATFORMS,
  else 'tpu'/'gpu' when /dev shows TPU chips or GPUs, else 'cpu'.

  platforms defaults to JAX's `jax_platforms` setting; accelerator_nodes (tests) says whether /dev shows accelerators.
  """
  import jax

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
  import jax

  return platform_of(jax.local_devices())


def device_kind() -> str:
  """The kind of this process's first device, e.g. 'TPU v5p' or 'NVIDIA H100 80GB HBM3' (the chip-table key)."""
  import jax

  return jax.local_devices()[0].device_kind


def check_hardware(config: PolicyKeys) -> None:
  """config.hardware (unless 'auto') must name the platform JAX runs on; a mismatch is a ConfigError."""
  if config.hardware == "auto":
    return
  want, have = _HARDWARE_PLATFORM[config.hardware], local_platform()
  if want != have:
    raise ConfigError(f"hardware={config.hardware} but JAX runs on '{have}'; set hardware=auto or hardware={have}, or fix the JAX install")


def backend_started() -> bool:
  """Whether JAX has initialised a backend in this process (asking it for devices would not start one)."""
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # no public API says this; the tests check it too

  return xla_bridge.backends_are_initialized()


def device_counts(config: PolicyKeys, start: bool = False) -> tuple[int, int]:
  """(devices, slices) of this run: JAX's own devices when its backend is up or start=True (entry points, once the
  process has joined the distributed system), else predicted without starting JAX (`predicted_device_counts`)."""
  import jax

  if start or backend_started():
    devices = jax.devices()
    return len(devices), len({getattr(d, "slice_index", 0) for d in devices})
  return predicted_device_counts(predict(config))


_FORCED_CPU_DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def predicted_device_counts(platform: str, env: Mapping[str, str] | None = None) -> tuple[int, int]:
  """(devices, slices) JAX would show on platform, decided without starting it.

  cpu: jax_num_cpu_devices, else XLA_FLAGS' --xla_force_host_platform_device_count, else 1. gpu: the GPUs in
  CUDA_VISIBLE_DEVICES, else in /dev. tpu: this host's chips (one JAX device each, v4 and later) times the hosts
  of TPU_WORKER_HOSTNAMES, in MEGASCALE_NUM_SLICES slices. Launchers that start one process per GPU, and TPU VMs
  that list their workers only in the metadata server, need JAX's own count (`device_counts(start=True)`).
  """
  import jax

  env = os.environ if env is None else env
  slices = 1
  if platform == "cpu":
    forced = _FORCED_CPU_DEVICES.search(env.get("XLA_FLAGS", ""))
    configured = jax.config.jax_num_cpu_devices
    local = configured if configured > 0 else int(forced.group(1)) if forced else 1
  elif platform == "gpu":
    visible = env.get("CUDA_VISIBLE_DEVICES")
    local = len([d for d in visible.split(",") if d.strip()]) if visible is not None else len(_nodes(_GPU_NODES))
  else:
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    slices = int(env.get("MEGASCALE_NUM_SLICES") or 1)
    local = len(_nodes(_TPU_NODES))
    return max(local, 1) * max(len(hosts), 1) * slices, slices
  return max(local, 1), slices


_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def _has_cuda() -> bool:
  """A jax CUDA plugin is installed and /dev shows an NVIDIA GPU."""
  return has_gpus() and any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)


def choose_platform(env: MutableMapping[str, str] | None = None, tpu_chips: bool | None = None, cuda: bool | None = None) -> str | None:
  """On a host without TPU chips, keep JAX off the TPU backend so an installed libtpu neither starts nor logs.

  With JAX_PLATFORMS unset and no TPU chips in /dev, sets JAX_PLATFORMS to 'cuda,cpu' (a GPU and a jax CUDA
  plugin are present) or 'cpu', and returns it; returns None and changes nothing when JAX_PLATFORMS is set or
  TPU chips are present or JAX has started. `import maxtext` runs it, so the library, the entry points and
  scripts all pick the same platform; it takes effect when it runs before JAX starts (after `import jax` is fine).
  AOT compilation for TPU topologies does not need the TPU backend (train_compile runs with JAX_PLATFORMS=cpu).
  """
  env = os.environ if env is None else env
  if env.get("JAX_PLATFORMS") or (env is os.environ and backend_started()):  # set, or too late to matter
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
