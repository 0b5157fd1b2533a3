"""Collective bytes that cross between device groups in a compiled XLA module, read from its HLO text.

The devices split into consecutive groups of `group_size` ids (DiLoCo's 'diloco' axis is outermost, so a group's
devices are consecutive; for plain data parallelism the same split names the data-parallel replicas). A collective
crosses groups when one of its replica groups (or a collective-permute's source-target pair) holds devices of two
groups; it contributes the bytes of its result on one device. Collectives inside a `conditional`'s branches (and
what they call) are counted apart, as `in_branches`: DiLoCo's synchronisation runs there, once every H steps. A
collective inside a while loop (a scan over layers) counts once per iteration (XLA's known trip count).
"""

from __future__ import annotations

import re

import numpy as np
from hlo_collectives import _OP, _TRIPS, _WHILE, _shape_bytes

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")  # mesh['axis_0'=2,'axis_1'=2] {'axis_1'}: groups vary over the named axes
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_BRANCHES = re.compile(r"(?:branch_computations=\{([%\w.\-, ]+)\}|true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+))")
_CALLS = re.compile(r"(?:to_apply|calls|branch_computations|called_computations|true_computation|false_computation)=\{?([%\w.\-, ]+)\}?")


def _replica_groups(line: str) -> list[list[int]]:
  listed = _GROUPS_LIST.search(line)
  if listed:
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
  iota = _GROUPS_IOTA.search(line)
  if iota:
    shape = [int(d) for d in iota.group(1).split(",")]
    dims = [int(d) for d in iota.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
    return ids.reshape(shape).tolist()
  mesh = _GROUPS_MESH.search(line)
  if mesh:
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))]
    over = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in mesh.group(2)]
    ids = np.arange(int(np.prod([size for _, size in axes]))).reshape([size for _, size in axes])
    kept = [i for i in range(len(axes)) if i not in over]
    return ids.transpose(kept + over).reshape(-1, int(np.prod([axes[i][1] for i in over], dtype=int))).tolist()
  pairs = _PAIRS.search(line)
  if pairs:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
  return []


def _computations(hlo_text: str) -> dict[str, list[str]]:
  computations: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line.strip())
    if header and ("->" in line or line.startswith("ENTRY")):
      current = header.group(1)
      computations[current] = []
    elif line.strip() == "}":
      current = None
    elif current is not None:
      computations[current].append(line)
  return computations


def _runs(computations: dict[str, list[str]], entry: str) -> dict[str, int]:
  """How often each computation runs per run of the module: while bodies times XLA's known trip count."""
  edges: dict[str, list[tuple[str, int]]] = {}
  for name, lines in computations.items():
    for line in lines:
      loop = _WHILE.search(line)
      if loop:
        trips = _TRIPS.search(line)
        n = int(trips.group(1)) if trips else 1
        edges.setdefault(name, []).extend([(loop.group(1), n), (loop.group(2), n)])
        continue
      edges.setdefault(name, []).extend((c.strip().lstrip("%"), 1) for group in _CALLS.findall(line) for c in group.split(",") if c.strip())
  runs: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    runs[name] = runs.get(name, 0) + times
    for callee, n in edges.get(name, []):
      if callee in computations:
        visit(callee, times * n)

  visit(entry, 1)
  return runs


def cross_group_bytes(hlo_text: str, group_size: int) -> dict[str, float]:
  """{'every_step': bytes crossing groups outside conditionals, 'in_branches': inside them} per device and run of the
  module (a collective in a while loop counts its known trip count times)."""
  computations = _computations(hlo_text)
  entry = next(line for line in hlo_text.splitlines() if line.startswith("ENTRY"))
  runs = _runs(computations, _HEADER.match(entry.strip()).group(1))
  calls = {
    name: [
      c.strip().lstrip("%")
      for line in lines
      for group in _CALLS.findall(line) + [g for m in _WHILE.findall(line) for g in m]
      for c in group.split(",")
      if c.strip()
    ]
    for name, lines in computations.items()
  }
  branch_roots = [
    c.strip().lstrip("%")
    for lines in computations.values()
    for line in lines
    for m in _BRANCHES.findall(line)
    for group in m
    for c in group.split(",")
    if c.strip()
  ]
  in_branch: set[str] = set()
  todo = list(branch_roots)
  while todo:
    name = todo.pop()
    if name in in_branch or name not in computations:
      continue
    in_branch.add(name)
    todo += calls.get(name, [])
  totals = {"every_step": 0.0, "in_branches": 0.0}
  for name, lines in computations.items():
    for line in lines:
      op = _OP.search(line)
      if not op or not runs.get(name):
        continue
      groups = _replica_groups(line)
      crosses = not groups or any(len({d // group_size for d in g}) > 1 for g in groups)  # no groups listed: all devices
      if not crosses:
        continue
      shape = op.group(1)
      if op.group(3) and shape.startswith("("):  # async start: (operands..., results...) -> the results half
        shape = shape[: len(shape) // 2] if op.group(2) != "all-gather" else shape
      totals["in_branches" if name in in_branch else "every_step"] += _shape_bytes(shape) * runs[name]
  return totals
