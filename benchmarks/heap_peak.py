"""What an XLA executable's temporary heap holds at its peak, from a `--xla_dump_to` directory.

    XLA_FLAGS=--xla_dump_to=DIR python -m maxtext.train_compile configs/base.yml ...
    python benchmarks/heap_peak.py DIR [--top 30] [--module jit_train_step]

Reads the module's `*after_optimizations-buffer-assignment.txt` (which values share the largest
preallocated-temp allocation, and their sizes) and `*after_optimizations-live-range.txt` (each value's
first and last position in the flattened schedule, loop bodies included), then prints:

- the heap size, the position where the summed sizes of the live values peak and the instruction there;
- the largest values live at that position (size, value, shape, live range, the instruction defining it);
- per stretch of the schedule between two `while` instructions, the largest live total in it, so a peak
  inside a layer loop can be told from one outside.

Values that share a buffer (an in-place update and its operand) are counted once each, so the live total
may exceed the heap; the heap is what the buffer assignment packed.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import NamedTuple

_VALUE = re.compile(r" value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=\d+\): (.*)")
_ALLOCATION = re.compile(r"allocation \d+: size (\d+)(.*)")
_RANGE = re.compile(r"\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$")
_POSITION = re.compile(r"\s+(\d+):(\S+)$")


class Value(NamedTuple):
  name: str
  size: int
  shape: str
  start: int
  end: int


def _file(dump: str, module: str, suffix: str) -> str:
  paths = sorted(glob.glob(os.path.join(dump, f"*{module}*{suffix}")))
  if not paths:
    sys.exit(f"no *{module}*{suffix} in {dump}: compile with XLA_FLAGS=--xla_dump_to={dump}")
  return paths[0]


def heap_values(assignment: str) -> tuple[int, list[tuple[str, int, str]]]:
  """(size of the largest preallocated-temp allocation, its values as (name{index}, bytes, shape))."""
  allocations: list[tuple[int, bool, list]] = []
  for line in assignment.splitlines():
    m = _ALLOCATION.match(line)
    if m:
      allocations.append((int(m.group(1)), "preallocated-temp" in m.group(2), []))
      continue
    m = _VALUE.match(line)
    if m and allocations:
      allocations[-1][2].append((m.group(1) + (m.group(2) or "{}"), int(m.group(3)), m.group(4)))
  size, _, values = max((a for a in allocations if a[1]), key=lambda a: a[0])
  return size, values


def live_ranges(text: str) -> tuple[dict[str, tuple[int, int]], dict[int, str]]:
  """(value -> (first, last) schedule position, position -> instruction name)."""
  ranges, order = {}, {}
  for line in text.splitlines():
    m = _RANGE.match(line)
    if m:
      ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
      continue
    m = _POSITION.match(line)
    if m:
      order[int(m.group(1))] = m.group(2)
  return ranges, order


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dump")
  parser.add_argument("--module", default="jit_train_step")
  parser.add_argument("--top", type=int, default=30)
  args = parser.parse_args(argv)
  with open(_file(args.dump, args.module, "after_optimizations-buffer-assignment.txt")) as f:
    heap, raw = heap_values(f.read())
  with open(_file(args.dump, args.module, "after_optimizations-live-range.txt")) as f:
    ranges, order = live_ranges(f.read())
  values = [Value(name, size, shape, *ranges[name]) for name, size, shape in raw if name in ranges]
  end = max(order) + 2
  live = [0] * end
  for v in values:
    live[v.start] += v.size
    live[v.end + 1] -= v.size
  for t in range(1, end):
    live[t] += live[t - 1]
  peak = max(range(end), key=live.__getitem__)
  print(f"heap {heap / 1e9:.2f} GB; live values peak at {peak} ({order.get(peak)}): {live[peak] / 1e9:.2f} GB")
  at_peak = sorted((v for v in values if v.start <= peak <= v.end), key=lambda v: -v.size)
  for v in at_peak[: args.top]:
    print(f"  {v.size / 1e9:7.3f} GB  {v.name:44s} {v.shape[:64]:64s} {v.start}-{v.end} ({order.get(v.start)})")
  print("largest live total between consecutive while instructions:")
  marks = [0, *sorted(t for t, name in order.items() if name.startswith("while")), end - 1]
  for a, b in zip(marks, marks[1:]):
    t = max(range(a, b + 1), key=live.__getitem__)
    print(f"  {a:6d}-{b:6d} {order.get(b, 'end'):14s} {live[t] / 1e9:7.2f} GB at {t} ({order.get(t)})")


if __name__ == "__main__":
  main(sys.argv[1:])
