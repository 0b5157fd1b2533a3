"""The local checkpoint tier (enable_emergency_checkpoint, enable_multi_tier_checkpointing): frequent saves of each
process's own shards to a directory on its own disk, with a copy on the next process, beside the persistent
(Orbax) checkpoints of maxtext.train.checkpointing.

Layout under local_checkpoint_directory (the same path on every host; <run_name>/ keeps runs apart, process_<i>/
processes that share one file system):

    <run_name>/process_<i>/<step>/own.bin        process i's shards of the train state and its data-iterator state
    <run_name>/process_<i>/<step>/peer_<j>.bin   process j's own.bin (j = i - 1 mod processes), sent over the device network

A file is written under a temporary name and renamed, so a file that exists is complete. The newest KEEP steps
are kept. A restore takes the newest step that every process can complete from its own file or from the copy on
the next process (sent back the same way), when it is newer than the newest persistent step; else the persistent
checkpoints are used. Local steps restore only onto the layout that saved them (same processes and devices): a
run on another layout restores from persistent storage, which reshards.

Orbax's emergency CheckpointManager (orbax.checkpoint.experimental.emergency) does the same job for multi-slice
TPU jobs, but it needs a mesh whose replica axis spans at least two slices (it restores a lost slice by
broadcasting from a healthy replica); processes that together hold one copy of the state, as here and on one
slice, are outside what it supports, so this module moves the shards itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext.config import MaxTextConfig
from maxtext.distributed import all_processes_agree

KEEP = 2  # local steps kept per process (the newest)
OWN = "own.bin"
FORMAT = 1


def enabled(config: MaxTextConfig) -> bool:
  return bool(config.enable_emergency_checkpoint or config.enable_multi_tier_checkpointing)


@dataclasses.dataclass
class LocalRestore:
  state: Any
  step: int
  data_state: dict[str, Any] | None
  peers: list[int]  # processes whose shards came from the next process's copy


def _index_key(leaf: int, index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
  parts = [f"{s.start or 0}:{shape[d] if s.stop is None else s.stop}" for d, s in enumerate(index)]
  return f"{leaf}[{','.join(parts)}]"


def pack(state: Any, meta: dict[str, Any]) -> bytes:
  """This process's shards of every array in state (each distinct shard once) and meta, as one byte string."""
  leaves = jax.tree_util.tree_leaves(state)
  entries, chunks, offset = {}, [], 0
  for i, leaf in enumerate(leaves):
    shards = [(s.index, s.data) for s in leaf.addressable_shards] if isinstance(leaf, jax.Array) else [((), leaf)]
    shape = tuple(np.shape(leaf))
    for index, data in shards:
      key = _index_key(i, index, shape)
      if key in entries:
        continue
      raw = np.asarray(data)
      blob = raw.tobytes()  # C order, whatever the layout
      entries[key] = [raw.dtype.name, list(raw.shape), offset, len(blob)]
      chunks.append(blob)
      offset += len(blob)
  data = b"".join(chunks)
  header = json.dumps({"format": FORMAT, "meta": meta, "leaves": len(leaves), "arrays": entries, "crc": zlib.crc32(data)}).encode()
  return struct.pack("<Q", len(header)) + header + data


def read_header(payload: bytes) -> dict[str, Any]:
  (n,) = struct.unpack("<Q", payload[:8])
  return json.loads(payload[8 : 8 + n])


def unpack(payload: bytes, abstract_state: Any) -> Any:
  """The train state from pack()'s bytes, in the shardings abstract_state carries (the layout that saved it)."""
  header = read_header(payload)
  data = memoryview(payload)[8 + struct.unpack("<Q", payload[:8])[0] :]
  if zlib.crc32(data) != header["crc"]:
    raise ValueError("its shard data differs from the checksum written with it")
  leaves, treedef = jax.tree_util.tree_flatten(abstract_state)
  if header["leaves"] != len(leaves):
    raise ValueError(f"it holds {header['leaves']} arrays, this train state has {len(leaves)}")
  out = []
  for i, leaf in enumerate(leaves):
    shape = tuple(leaf.shape)
    per_device = []
    for device, index in leaf.sharding.addressable_devices_indices_map(shape).items():
      key = _index_key(i, index, shape)
      if key not in header["arrays"]:
        raise ValueError(f"it lacks the shard {key} (saved on another device layout)")
      dtype, dims, offset, size = header["arrays"][key]
      want = tuple(len(range(*s.indices(dim))) for s, dim in zip(index, shape))  # this device's shard shape
      if math.prod(dims) != math.prod(want):
        raise ValueError(f"its shard {key} holds {dims}, this layout needs {list(want)}")
      host = np.frombuffer(data[offset : offset + size], dtype=jnp.dtype(dtype)).reshape(want)
      per_device.append(jax.device_put(host, device))
    out.append(jax.make_array_from_single_device_arrays(shape, leaf.sharding, per_device))
  return jax.tree_util.tree_unflatten(treedef, out)


def _process_mesh() -> jax.sharding.Mesh:
  """One device of each process, in process order: the ring the copies travel on."""
  firsts = {}
  for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
    firsts.setdefault(d.process_index, d)
  return jax.sharding.Mesh(np.array([firsts[p] for p in range(jax.process_count())]), ("processes",))


def _allgather_sizes(size: int) -> list[int]:
  from jax.experimental import multihost_utils

  return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.asarray([size], np.int64))).reshape(-1)]


def ring_send(payload: bytes, shift: int) -> bytes:
  """Send payload to process (this + shift) mod processes and return what process (this - shift) sent: one
  collective permute of each process's bytes (no process receives more than one peer's data)."""
  n = jax.process_count()
  sizes = _allgather_sizes(len(payload))
  width = max(max(sizes), 1)
  mesh = _process_mesh()
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("processes"))
  buf = np.zeros((1, width), np.uint8)
  buf[0, : len(payload)] = np.frombuffer(payload, np.uint8)
  mine = mesh.devices[jax.process_index()]
  arr = jax.make_array_from_single_device_arrays((n, width), sharding, [jax.device_put(buf, mine)])
  perm = [(i, (i + shift) % n) for i in range(n)]
  with jax.set_mesh(mesh):  # the loop's own mesh is set around saves and restores
    moved = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "processes", perm), mesh=mesh, in_specs=sharding.spec, out_specs=sharding.spec))(arr)
  source = (jax.process_index() - shift) % n
  return np.asarray(moved.addressable_shards[0].data)[0, : sizes[source]].tobytes()


def _write(path: Path, payload: bytes) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    f.write(payload)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


class LocalTier:
  """Saves and restores the local tier of one process (all processes call save and restore together)."""

  def __init__(self, config: MaxTextConfig):
    self.config = config
    self.root = Path(config.local_checkpoint_directory) / config.run_name
    self.dir = self.root / f"process_{jax.process_index()}"
    self.period = config.local_checkpoint_period
    self.n = jax.process_count()

  def due(self, steps_done: int) -> bool:
    return steps_done % self.period == 0

  def _layout(self) -> dict[str, Any]:
    return {"process_count": self.n, "num_devices": jax.device_count(), "mesh": {k: int(v) for k, v in self._mesh_shape().items()}}

  def _mesh_shape(self) -> dict[str, int]:
    return dict(zip(self.config.mesh_axes, [int(i) * int(d) for i, d in zip(self.config.ici_parallelism, self.config.dcn_parallelism)]))

  def save(self, step: int, state: Any, data_state: dict[str, Any] | None) -> None:
    """Write this process's shards after `step` steps (synchronously), then the previous process's copy."""
    payload = pack(state, {"step": step, "process_index": jax.process_index(), "data_state": data_state, **self._layout()})
    _write(self.dir / str(step) / OWN, payload)
    if self.n > 1:
      peer = ring_send(payload, 1)
      _write(self.dir / str(step) / f"peer_{(jax.process_index() - 1) % self.n}.bin", peer)
    self._prune()

  def _prune(self) -> None:
    steps = self._steps()
    for step in steps[:-KEEP]:
      shutil.rmtree(self.dir / str(step), ignore_errors=True)

  def has_steps(self) -> bool:
    """Whether this process holds any local step (a restart may restore from it)."""
    return bool(self._steps())

  def _steps(self) -> list[int]:
    if not self.dir.is_dir():
      return []
    return sorted(int(d.name) for d in self.dir.iterdir() if d.name.isdigit() and d.is_dir())

  def _usable(self, file: Path) -> bool:
    """The file exists and was written by this layout (processes, devices, mesh)."""
    try:
      with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))["meta"]
    except (OSError, ValueError, struct.error, KeyError):
      return False
    return all(meta.get(k) == v for k, v in self._layout().items())

  def _inventory(self) -> tuple[list[set[int]], list[set[int]]]:
    """Per process: the steps it holds its own usable file of, and the steps it holds its previous process's copy of."""
    prev = (jax.process_index() - 1) % self.n
    own = [s for s in self._steps() if self._usable(self.dir / str(s) / OWN)]
    peer = [s for s in self._steps() if self.n > 1 and self._usable(self.dir / str(s) / f"peer_{prev}.bin")]
    mine = json.dumps([own, peer]).encode()
    if self.n == 1:
      return [set(own)], [set(peer)]
    from jax.experimental import multihost_utils

    sizes = _allgather_sizes(len(mine))
    buf = np.zeros(max(sizes), np.uint8)
    buf[: len(mine)] = np.frombuffer(mine, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf))
    lists = [json.loads(rows[p, : sizes[p]].tobytes()) for p in range(self.n)]
    return [set(o) for o, _ in lists], [set(p) for _, p in lists]

  def restore(self, abstract_state: Any, newer_than: int | None, log: Callable[[str], None]) -> LocalRestore | None:
    """The newest local step newer than `newer_than` (the newest persistent step) that every process can complete
    from its own file or from the next process's copy; None when there is none. A step whose data does not read
    on some process is reported and the next older one tried."""
    own, held = self._inventory()
    me = jax.process_index()
    complete = []
    for step in sorted(set().union(*own, *held), reverse=True):
      if newer_than is not None and step <= newer_than:
        break
      if all(step in own[p] or (self.n > 1 and step in held[(p + 1) % self.n]) for p in range(self.n)):
        complete.append(step)
    if not complete and any(own) | any(held):
      newest = "" if newer_than is None else f" newer than the newest persistent step {newer_than}"
      log(f"no local checkpoint step in {self.root}{newest} is complete on every process (own files or peer copies)")
    for step in complete:
      missing = [p for p in range(self.n) if step not in own[p]]
      problem, result = None, None
      try:
        if missing:  # the next process sends back the copy it holds
          prev = (me - 1) % self.n
          copy = (self.dir / str(step) / f"peer_{prev}.bin").read_bytes() if prev in missing else b""
          got = ring_send(copy, -1)
          if me in missing:
            _write(self.dir / str(step) / OWN, got)  # this host's own copy again
        payload = (self.dir / str(step) / OWN).read_bytes()
        header = read_header(payload)
        result = LocalRestore(unpack(payload, abstract_state), step, header["meta"].get("data_state"), missing)
      except Exception as e:  # noqa: BLE001 - a local file that does not read makes the step unusable here
        problem = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
      if all_processes_agree(problem is None):
        return result
      if problem is not None:
        log(f"local checkpoint of step {step} in {self.dir} is unusable ({problem}); trying an older one")
    return None


def backup_due(config: MaxTextConfig, seconds_since_persistent: float) -> bool:
  """enable_multi_tier_checkpointing with a backup interval: a local save becomes persistent once the interval passed."""
  minutes = config.multi_tier_checkpointing_backup_interval_minutes
  return bool(config.enable_multi_tier_checkpointing and minutes is not None and seconds_since_persistent >= 60 * minutes)


def restore_newer(local: LocalTier, abstract_state: Any, config: MaxTextConfig, ckpt: Any, data_iter: Any, log: Callable[[str], None]) -> Any | None:
  """The train state of the newest local step newer than the newest persistent one (data_iter moved to its data
  position), with one line saying where every process's shards came from; None: restore from persistent storage."""
  from maxtext.train import checkpointing
  from maxtext.train import state as state_lib

  restored = local.restore(state_lib.checkpointed(abstract_state, config), ckpt.latest_step(), log)
  if restored is None:
    return None
  problem = None
  if data_iter is not None and restored.data_state is not None:
    problem = checkpointing.moved_to(data_iter, restored.data_state, local.dir / str(restored.step))
  if not all_processes_agree(problem is None):
    log(f"local checkpoint of step {restored.step} in {local.root} has an unusable data position ({problem or 'on another process'}); using persistent storage")
    return None
  n = jax.process_count()
  where = (
    "every process from its own copy"
    if not restored.peers
    else "; ".join(f"process {p} from the copy on process {(p + 1) % n}" for p in restored.peers) + ", the others from their own copies"
  )
  log(f"restored checkpoint at step {restored.step} from the local checkpoints in {local.root} ({where})")
  return restored.state
