"""Checksums of a train state's arrays: what a checkpoint records when it is saved and checks when it is restored.

Each array's checksum is a position-weighted sum of its bit patterns, modulo 2**32:
sum_i (bits_i ^ K) * (2 i + 1), with i the element's row-major index. The weights are odd, so a change to any one
element always changes the sum, and any other change does with probability 1 - 2**-32. It is computed where the
array lives, sharded, in one jitted reduction (no array is gathered or copied to the host), and it depends only on
the values, not on the sharding or the device count. Arrays kept in host memory (optimizer_memory_host_offload)
are left out: XLA computes on device memory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MIX = np.uint32(0x9E3779B9)  # XORed into every bit pattern, so that zeros count too


def _bits(x: jax.Array) -> jax.Array:
  """x's bit patterns as uint32 (8-byte elements as two words along a new last axis)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
  bits = _bits(x)
  index = jnp.zeros(bits.shape, jnp.uint32)
  for axis, size in enumerate(bits.shape):  # the row-major index, built per axis so that it shards like the array
    index = index * np.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
  return jnp.sum((bits ^ MIX) * (index * np.uint32(2) + np.uint32(1)), dtype=jnp.uint32)


def _covered(x: Any) -> bool:
  """An array whose checksum we take: on device memory, of a dtype with whole bytes per element."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or not hasattr(x, "shape"):
    return False
  if jnp.dtype(dtype).itemsize not in (1, 2, 4, 8) or "int4" in jnp.dtype(dtype).name or "float4" in jnp.dtype(dtype).name:
    return False
  sharding = getattr(x, "sharding", None)
  return getattr(sharding, "memory_kind", None) in (None, "device")


def _name(path: tuple) -> str:
  names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
  return "/".join(names[:-1] if names and names[-1] == "value" else names)


_jitted = jax.jit(lambda leaves: [_checksum(x) for x in leaves])


def of_state(state: Any) -> dict[str, list]:
  """'/'-path -> [dtype name, checksum] of every covered array of state (blocks until they are computed)."""
  named = [(_name(path), x) for path, x in jax.tree_util.tree_flatten_with_path(state)[0] if _covered(x)]
  if not named:
    return {}
  sums = jax.device_get(_jitted([x for _, x in named]))
  return {name: [jnp.dtype(x.dtype).name, int(s)] for (name, x), s in zip(named, sums, strict=True)}


def mismatches(recorded: dict[str, Any], state: Any) -> list[str]:
  """The arrays of state whose checksum differs from the recorded one (those recorded in the same dtype; a
  checkpoint restored into another dtype, e.g. a changed mu_dtype, is not comparable bit for bit)."""
  now = of_state(state)
  bad = []
  for name, (dtype, value) in now.items():
    entry = recorded.get(name)
    if isinstance(entry, list) and len(entry) == 2 and entry[0] == dtype and entry[1] != value:
      bad.append(name)
  return sorted(bad)
