"""Goodput: where a run's wall time went (enable_goodput_recording, monitor_goodput).

The loop is always in exactly one phase; `Goodput.phase(name)` switches to another for a while, so the phases add up
to the wall time by construction. Compilation is carved out of whichever phase it happened in, from JAX's own compile
events (tracing, lowering and the backend compile). Step time is what the loop spends between two logged steps
outside every other phase (the loop fetches a step's metrics one step late, so this costs no host sync per step);
it is productive, or lost when the step was already reached by an earlier attempt that a preemption cut short and is
being recomputed from an older checkpoint. The furthest step reached is kept in the run directory
(`goodput_progress.json`) and the breakdown of every attempt in `goodput.json`. Both go through etils epath, as the
checkpoints do (local paths and gs://); the progress file is rewritten by a background thread with the newest
furthest step, so a slow file system never holds up the step loop.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
from etils import epath

PARTS = ("productive_steps", "lost_steps", "initialization", "compilation", "data_waiting", "checkpoint_save", "checkpoint_restore", "evaluation", "finishing")
STEP = "step"  # the loop's own phase: step time, sorted into productive_steps or lost_steps when the step is logged
REPORT_FILE = "goodput.json"
PROGRESS_FILE = "goodput_progress.json"
_COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)
_compile_seconds = 0.0  # JAX compile time in this process so far (the listener below adds to it)
_listening = False


def _on_event(event: str, seconds: float, **_: Any) -> None:
  global _compile_seconds
  if event in _COMPILE_EVENTS:
    _compile_seconds += seconds


def _listen() -> None:
  global _listening
  if not _listening:
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    _listening = True


_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="goodput")  # the progress files' writes, in order


def read_furthest(run_dir: str) -> int:
  """Steps reached by the furthest earlier attempt of the run in run_dir (0 when none was recorded)."""
  _writer.submit(lambda: None).result()  # this process's own pending writes land first
  try:
    return int(json.loads((epath.Path(run_dir) / PROGRESS_FILE).read_text())["furthest_step"])
  except (OSError, ValueError, KeyError, TypeError):
    return 0


def _write_json(path: epath.Path, value: Any) -> None:
  """Replace path (a kill leaves the old or the new file, never half of one, where the file system renames atomically)."""
  tmp = path.parent / f"{path.name}.tmp"
  tmp.write_text(json.dumps(value, indent=1))
  tmp.replace(path)


class ProgressFile:
  """goodput_progress.json, written in the background: `record` only notes the newest furthest step and returns; one
  write at a time runs on a worker thread and writes the newest step noted by then (steps noted meanwhile are
  merged). A write that failed is raised by the next `record` or `flush`, in the loop's thread."""

  def __init__(self, run_dir: str):
    self.path = epath.Path(run_dir) / PROGRESS_FILE
    self._lock = threading.Lock()
    self._wanted = self._written = 0
    self._running: Future | None = None
    self._error: BaseException | None = None

  def record(self, furthest_step: int) -> None:
    self._raise()
    with self._lock:
      self._wanted = max(self._wanted, furthest_step)
      if self._running is None:
        self._running = _writer.submit(self._write)

  def _write(self) -> None:
    while True:
      with self._lock:
        wanted = self._wanted
        if wanted == self._written or self._error is not None:
          self._running = None
          return
      try:
        _write_json(self.path, {"furthest_step": wanted})
      except BaseException as e:  # noqa: BLE001 - handed to the loop's thread by _raise
        with self._lock:
          self._error, self._running = e, None
        return
      self._written = wanted

  def flush(self) -> None:
    """Wait for the newest noted step to be written."""
    _writer.submit(lambda: None).result()
    self._raise()

  def _raise(self) -> None:
    if self._error is not None:
      error, self._error = self._error, None
      raise error


def percent(part: float, whole: float) -> str:
  return f"{100 * part / whole:.1f}%" if whole > 0 else "n/a"


class Goodput:
  """The time accounting of one call of train(); `enabled` (enable_goodput_recording or monitor_goodput) decides
  whether anything is written or printed, `monitor` whether the running figure is logged every log_period steps."""

  def __init__(self, recording: bool, monitor: bool, log_period: int):
    self.recording, self.monitor, self.log_period = recording, monitor, log_period
    self.enabled = recording or monitor
    _listen()
    self.began = time.perf_counter()
    self.seconds = dict.fromkeys(PARTS, 0.0)
    self.current, self.since, self.compile_mark = "initialization", self.began, _compile_seconds
    self.step_pending = 0.0  # step time since the last logged step
    self.run_dir: str | None = None  # set by `start`: where the files go (after every check passed, under the run lock)
    self.progress: ProgressFile | None = None
    self.furthest_before = 0  # steps an earlier attempt reached
    self.start_step = 0
    self.log: Callable[[str], None] = print
    self.lost_steps = 0
    self.productive_steps = 0

  def _switch(self, to: str) -> None:
    now = time.perf_counter()
    compiled = _compile_seconds - self.compile_mark
    elapsed = now - self.since
    compiled = min(max(compiled, 0.0), elapsed)
    if self.current == STEP:
      self.step_pending += elapsed - compiled
    else:
      self.seconds[self.current] += elapsed - compiled
    self.seconds["compilation"] += compiled
    self.current, self.since, self.compile_mark = to, now, _compile_seconds

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    """The time inside counts as `name` (one of PARTS, or STEP); then the previous phase resumes."""
    before = self.current
    self._switch(name)
    try:
      yield
    finally:
      self._switch(before)

  def start(self, run_dir: str, start_step: int, log: Callable[[str], None]) -> None:
    """Called once the state is restored: read how far earlier attempts got; from here on the loop's time is step time."""
    self.run_dir, self.start_step, self.log = run_dir, start_step, log
    self.furthest_before = read_furthest(run_dir) if self.enabled else 0
    self.progress = ProgressFile(run_dir) if self.enabled and jax.process_index() == 0 else None
    if self.enabled and self.furthest_before > start_step:
      log(
        f"goodput: resuming at step {start_step}; an earlier attempt reached step {self.furthest_before}, so {self.furthest_before - start_step} steps are recomputed (lost)"
      )
    self._switch(STEP)

  def step_logged(self, step: int) -> None:
    """Step `step` has finished and was logged: its time is lost (recomputed) or productive; the furthest step is recorded."""
    self._switch(STEP)
    if step < self.furthest_before:
      self.seconds["lost_steps"] += self.step_pending
      self.lost_steps += 1
    else:
      self.seconds["productive_steps"] += self.step_pending
      self.productive_steps += 1
    self.step_pending = 0.0
    if self.progress is None:
      return
    if step + 1 > self.furthest_before:
      self.progress.record(step + 1)
    if self.monitor and (step + 1) % self.log_period == 0:
      self.log(f"goodput after step {step}: {self.line()}")

  def steps_ended(self) -> None:
    """After the last step is logged: the rest (summary, plot, closing writes) is finishing time."""
    self._switch("finishing")
    if self.progress is not None:
      self.progress.flush()

  def report(self) -> dict[str, Any]:
    """The breakdown so far: seconds per part, their sum, the wall time and the goodput fraction."""
    self._switch(self.current)
    parts = dict(self.seconds)
    parts["productive_steps"] += self.step_pending  # a step not yet logged (the loop logs every step before the end)
    wall = time.perf_counter() - self.began
    return {
      "wall_seconds": wall,
      "seconds": parts,
      "accounted_seconds": sum(parts.values()),
      "goodput": parts["productive_steps"] / wall if wall > 0 else 0.0,
      "steps": {"start": self.start_step, "productive": self.productive_steps, "lost": self.lost_steps, "furthest_before": self.furthest_before},
    }

  def line(self) -> str:
    r = self.report()
    wall, parts = r["wall_seconds"], r["seconds"]
    shown = ", ".join(f"{name.replace('_', ' ')} {percent(parts[name], wall)}" for name in PARTS[1:] if parts[name] > 0)
    return f"goodput {percent(parts['productive_steps'], wall)} of {wall:.1f}s" + (f" ({shown})" if shown else "")

  def finish(self) -> None:
    """At the end of train(): the summary line, and goodput.json in the run directory (every attempt, newest last)."""
    if not self.enabled:
      return
    self.log(self.line())
    if not self.recording or jax.process_index() != 0 or self.run_dir is None:
      return
    path = epath.Path(self.run_dir) / REPORT_FILE
    attempts: list[dict[str, Any]] = []
    try:
      attempts = list(json.loads(path.read_text())["attempts"])
    except (OSError, ValueError, KeyError, TypeError):
      attempts = []
    attempts.append(self.report())
    total = {name: sum(a["seconds"][name] for a in attempts) for name in PARTS}
    wall = sum(a["wall_seconds"] for a in attempts)
    _write_json(path, {"attempts": attempts, "total_seconds": total, "total_wall_seconds": wall, "goodput": total["productive_steps"] / wall if wall else 0.0})
    self.log(f"goodput: {path}")
