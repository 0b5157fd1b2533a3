"""`python -m maxtext.plot <run dir | metrics file> [...] [--out PNG]`: training curves of one or more runs, overlaid.

A run is read from its TensorBoard events (`<run dir>/tensorboard/`, what every run writes by default) or from a
JSON-lines `metrics_file`. The PNG has four panels against step: train and eval loss, learning rate,
tokens/s/device and gradient norm; DPO runs add reward accuracy and margin, GRPO runs mean reward and KL. Each finished run also writes `<run dir>/training_curves.png` this way.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import struct
import sys
from collections.abc import Sequence

from etils import epath

from maxtext.cli import entry
from maxtext.errors import DataError

RUN_PNG = "training_curves.png"
Series = dict[str, dict[int, float]]  # metric name -> {step: value}
PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_device", "tokens/s/device"), ("grad_norm", "grad norm"))
# Panels added when a run logged the metric: DPO's reward accuracy and margin, GRPO's reward and KL.
OBJECTIVE_PANELS = (
  ("rewards/accuracy", "DPO reward accuracy"),
  ("rewards/margin", "DPO reward margin"),
  ("reward", "GRPO mean reward"),
  ("kl", "GRPO KL to the reference"),
)

USAGE = f"""usage: python -m maxtext.plot <run dir | metrics file> [more runs ...] [--out PNG]

Plot train and eval loss, learning rate, tokens/s/device and grad norm against step; several runs are overlaid.
A run is a run directory (<base_output_directory>/<run_name>, read from its tensorboard/ events), a TensorBoard
directory, or a JSON-lines metrics_file. --out defaults to {RUN_PNG} in the working directory.

example:
  python -m maxtext.plot maxtext_output/quickstart --out quickstart.png"""


def _read_events(path: str) -> Series:
  """Scalars of one TensorBoard event file (TFRecord framing: length, crc, Event proto, crc)."""
  from maxtext.tensorboard_import import import_tensorboardx

  event_pb2 = import_tensorboardx("tensorboardX.proto.event_pb2")

  series: Series = {}
  data = epath.Path(path).read_bytes()
  offset = 0
  while offset + 12 <= len(data):
    (length,) = struct.unpack("<Q", data[offset : offset + 8])
    record = data[offset + 12 : offset + 12 + length]
    offset += 12 + length + 4
    if len(record) < length:
      break  # a file still being written ends mid-record
    event = event_pb2.Event.FromString(record)
    for value in event.summary.value:
      if value.HasField("simple_value"):
        series.setdefault(value.tag.removeprefix("learning/"), {})[int(event.step)] = float(value.simple_value)
  return series


def _read_jsonl(path: str) -> Series:
  series: Series = {}
  for number, line in enumerate(epath.Path(path).read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      step = int(row.pop("step"))
    except (ValueError, KeyError, TypeError):
      raise DataError(f"metrics file '{path}' line {number} is not a JSON object with a 'step'; pass a metrics_file written by maxtext.train") from None
    for key, value in row.items():
      try:
        series.setdefault(key, {})[step] = float(value)
      except (TypeError, ValueError):
        continue
  return series


def read_run(path: str) -> Series:
  """Metrics of a run directory, TensorBoard directory or JSON-lines file; later files win on repeated steps (resumed runs)."""
  if os.path.isfile(path):
    return _read_jsonl(path)
  if not os.path.isdir(path):
    raise DataError(f"'{path}' is neither a run directory nor a metrics file; pass <base_output_directory>/<run_name> or a metrics_file")
  events = sorted(glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True), key=os.path.getmtime)
  files = events or sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True), key=os.path.getmtime)
  if not files:
    raise DataError(f"no TensorBoard events or *.jsonl metrics under '{path}'; train with enable_tensorboard=true or metrics_file=PATH")
  series: Series = {}
  for f in files:
    for key, values in (_read_events(f) if f in events else _read_jsonl(f)).items():
      series.setdefault(key, {}).update(values)
  return series


def panels_for(runs: Sequence[tuple[str, Series]]) -> tuple[tuple[str, str], ...]:
  """(metric, title) of each panel: the four of every run, then the objective panels of metrics some run logged."""
  return PANELS + tuple(p for p in OBJECTIVE_PANELS if any(series.get(p[0]) for _, series in runs))


def render(runs: Sequence[tuple[str, Series]]) -> bytes:
  """PNG bytes of the four panels, one colour per run (eval loss dashed)."""
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  panels = panels_for(runs)
  cols = 2 if len(panels) <= 4 else 3
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.5 * rows), dpi=110, squeeze=False)
  for ax in axes.flat[len(panels) :]:
    ax.set_visible(False)
  for (key, title), ax in zip(panels, axes.flat):
    for i, (label, series) in enumerate(runs):
      color = f"C{i % 10}"
      evals = series.get(f"eval_{key}", {})
      _line(ax, series.get(key, {}), color, f"{label} train" if evals or key == "loss" else label)
      _line(ax, evals, color, f"{label} eval", style="--", marker="o")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if key == "lr":
      ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if ax.lines:
      ax.legend(fontsize=8)
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png")
  plt.close(fig)
  return buffer.getvalue()


def _line(ax, values: dict[int, float], color: str, label: str, style: str = "-", marker: str | None = None) -> None:
  points = sorted((s, v) for s, v in values.items() if math.isfinite(v))
  if points:
    ax.plot([s for s, _ in points], [v for _, v in points], style, color=color, label=label, marker=marker, markersize=3)


def write(paths: Sequence[str], out: str) -> str:
  runs = [(os.path.basename(os.path.normpath(p)) or p, read_run(p)) for p in paths]
  png = render(runs)
  target = epath.Path(out)
  if target.parent and not target.parent.exists():
    raise DataError(f"output directory '{target.parent}' does not exist; create it or choose another --out")
  target.write_bytes(png)
  return str(target)


@entry(USAGE)
def main(argv: list[str]) -> None:
  out = RUN_PNG
  if "--out" in argv:
    i = argv.index("--out")
    if i + 1 >= len(argv):
      raise DataError("--out needs a file name, e.g. --out curves.png")
    out = argv[i + 1]
    argv = argv[:i] + argv[i + 2 :]
  if not argv:
    raise DataError("no run given; usage: python -m maxtext.plot <run dir | metrics file> [...] [--out PNG]")
  print(f"wrote {write(argv, out)}")


if __name__ == "__main__":
  main(sys.argv[1:])
