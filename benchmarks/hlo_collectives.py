"""Collective bytes per run of a compiled XLA module, read from its HLO text (shared by the benchmarks).

Every collective (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute; an async pair counts once,
at its -start) contributes the bytes of its result on one device, times the trip counts of the while loops around
it (XLA's known_trip_count; a loop without one counts once and is reported).
"""

from __future__ import annotations

import collections
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_WHILE = re.compile(r"\swhile\(.*condition=%?([\w.\-]+).*body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"(?:to_apply|calls|branch_computations|called_computations)=\{?([%\w.\-, ]+)\}?")


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * DTYPE_BYTES.get(dtype, 4)
  return total


def collective_bytes(hlo_text: str) -> dict[str, float]:
  """{kind: bytes per device per run} over the module, plus 'unknown_trip_loops' (loops counted once)."""
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line.strip())
    if header and ("->" in line or line.startswith("ENTRY")):
      current = header.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif line.strip() == "}":
      current = None
    elif current is not None:
      computations[current].append(line)
  edges: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  unknown = 0
  for name, lines in computations.items():
    for line in lines:
      loop = _WHILE.search(line)
      if loop:
        trips = _TRIPS.search(line)
        unknown += trips is None
        n = int(trips.group(1)) if trips else 1
        edges[name] += [(loop.group(1), n), (loop.group(2), n)]
        continue
      for group in _CALLS.findall(line):
        edges[name] += [(callee.strip().lstrip("%"), 1) for callee in group.split(",") if callee.strip()]
  runs: dict[str, int] = collections.defaultdict(int)

  def visit(name: str, times: int) -> None:
    runs[name] += times
    for callee, n in edges.get(name, []):
      if callee in computations:
        visit(callee, times * n)

  visit(entry, 1)
  totals: dict[str, float] = {kind: 0.0 for kind in KINDS}
  for name, lines in computations.items():
    for line in lines:
      op = _OP.search(line)
      if op and runs.get(name):
        shape = op.group(1)
        if op.group(3) and shape.startswith("("):  # async start: (operands..., results...) -> count the results half
          shape = shape[: len(shape) // 2] if op.group(2) != "all-gather" else shape
        totals[op.group(2)] += _shape_bytes(shape) * runs[name]
  totals["unknown_trip_loops"] = unknown
  return totals
