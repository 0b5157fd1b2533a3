"""Lower and compile one decode step (what maxtext.decode and the Generator run per token) for a TPU topology.

The model and its KV cache are abstract (ShapeDtypeStructs with the shardings the config's rules give them), so a
1T-parameter model compiles on a CPU host. The batch is per_device_batch_size x devices, each row holding
max_target_length tokens of cache.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtext import models, platform, topology
from maxtext.aot import memory
from maxtext.aot.compile import topology_mesh
from maxtext.config import MaxTextConfig
from maxtext.inference import cache_layout
from maxtext.inference.generate import Generator
from maxtext.mesh import logical_to_spec


@dataclasses.dataclass
class DecodeCompileResult:
  memory: memory.MemoryReport
  compile_seconds: float
  batch: int
  cache_line: str  # cache_layout.describe: the whole cache's size
  cache_bytes_per_device: int  # this device's shard of the cache

  def summary(self) -> dict[str, Any]:
    return {
      "compile_seconds": round(self.compile_seconds, 3),
      "batch": self.batch,
      **self.memory.fields(),
      "kv_cache_bytes_per_device": self.cache_bytes_per_device,
    }


def _sharded(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compile_decode_step(config: MaxTextConfig) -> DecodeCompileResult:
  """Compile Generator.step (one token per row against a max_target_length cache, the cache donated) for the topology."""
  mesh = topology_mesh(config)
  hbm = topology.parse(config.compile_topology).chip.hbm_bytes
  policy = platform.resolve(config, mesh)
  batch = config.micro_batch_size_to_train_on
  with jax.set_mesh(mesh):
    abstract_model = models.abstract_model(config, policy)
    gen = Generator(abstract_model, config=config, max_target_length=config.max_target_length, max_prefill_length=config.max_prefill_predict_length, mesh=mesh)
    shardings = models.state_shardings(gen.state, config, mesh)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    gen.state = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), gen.state, shardings, is_leaf=is_var)
    cache = cache_layout.abstract(config, batch, gen.layout)
    cache = _sharded(cache, cache_layout.shardings(config, mesh, cache))
    rows = jax.sharding.NamedSharding(mesh, logical_to_spec(("cache_batch",), config.logical_axis_rules, mesh))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
    start = time.perf_counter()
    try:
      compiled = gen.step.lower(gen.state, cache, tokens).compile()
      report = memory.from_compiled(compiled, hbm)
    except Exception as e:  # XLA reports exhausted memory as a runtime error at compile time
      if not memory.is_out_of_memory(e):
        raise
      report = memory.from_oom_error(e, memory.shard_bytes((gen.state, cache)), hbm)
    seconds = time.perf_counter() - start
  return DecodeCompileResult(report, seconds, batch, cache_layout.describe(config, batch, gen.layout), memory.shard_bytes(cache))
