"""Per-step metrics: the MaxText log line, TensorBoard scalars, Weights & Biases and a JSON-lines file (process 0 only)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from typing import Any

import jax
from etils import epath

from maxtext.config import MaxTextConfig
from maxtext.train import outputs

# Metrics of the DPO and GRPO objectives that the step line shows when a step reports them (TensorBoard and the
# metrics file get every metric).
OBJECTIVE_LINE_KEYS = (
  ("rewards/chosen", ".4f"),
  ("rewards/rejected", ".4f"),
  ("rewards/accuracy", ".3f"),
  ("rewards/margin", ".4f"),
  ("reward", ".4f"),
  ("reward_std", ".4f"),
  ("kl", ".5f"),
  ("clip_fraction", ".3f"),
  ("completion_length", ".1f"),
  ("rollout_share", ".2f"),
  ("scoring_share", ".2f"),
  ("update_share", ".2f"),
)


def format_line(step: int, m: dict[str, float]) -> str:
  line = (
    f"completed step: {step}, seconds: {m['seconds']:.3f}, TFLOP/s/device: {m['tflops_per_device']:.3f}, "
    f"Tokens/s/device: {m['tokens_per_device']:.3f}, total_weights: {int(m['total_weights'])}, loss: {m['loss']:.4f}, "
    f"lr: {m['lr']:.4e}, grad_norm: {m['grad_norm']:.4f}, MFU: {100 * m['mfu']:.2f}%"
  )
  line += "".join(f", {key}: {m[key]:{fmt}}" for key, fmt in OBJECTIVE_LINE_KEYS if key in m)
  if m.get("skipped"):
    line += ", skipped (loss spike)"
  return line


class MetricsWriter:
  """Writes step and eval metrics; only process 0 prints or writes files."""

  def __init__(self, config: MaxTextConfig):
    self.config = config
    self.is_main = jax.process_index() == 0
    self.tensorboard = None
    self.wandb = None
    self.file = None
    self._opened = False  # the TensorBoard directory and the metrics file are made by the first write, so a run
    # that fails before its first step (e.g. out of memory) leaves neither behind

  def _open(self) -> None:
    if self._opened or not self.is_main:
      return
    self._opened = True
    if self.config.enable_tensorboard:
      from maxtext.tensorboard_import import import_tensorboardx

      self.tensorboard = import_tensorboardx().SummaryWriter(self.config.tensorboard_dir)
    if self.config.enable_wandb:
      from maxtext.train.wandb_run import WandbRun

      self.wandb = WandbRun(self.config)
    if self.config.metrics_file:
      with self._writing():
        path = epath.Path(self.config.metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

  @contextlib.contextmanager
  def _writing(self) -> Iterator[None]:
    """A full or read-only metrics_file location becomes a one-line OutputError naming it."""
    try:
      yield
    except OSError as e:
      error = outputs.as_user_error(e, self.config.metrics_file, 0, "metrics_file")
      if error is None:
        raise
      raise error from None

  def log(self, message: str) -> None:
    if self.is_main:
      print(message, flush=True)

  def write(self, step: int, metrics: dict[str, Any], line: str | None = None) -> None:
    """metrics: plain floats. `line` is printed if given. Flushes every log_period steps (and the loop flushes at every checkpoint)."""
    if not self.is_main:
      return
    if line:
      print(line, flush=True)
    self._open()
    clean = {k: float(v) for k, v in metrics.items()}
    if self.tensorboard is not None:
      for key, value in clean.items():
        if math.isfinite(value):
          self.tensorboard.add_scalar(f"learning/{key}", value, step)
    if self.wandb is not None:
      self.wandb.log(step, clean)
    if self.file is not None:
      with self._writing():
        self.file.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}) + "\n")
    if (step + 1) % self.config.log_period == 0:
      self.flush()

  def flush(self) -> None:
    if self.tensorboard is not None:
      self.tensorboard.flush()
    if self.file is not None:
      with self._writing():
        self.file.flush()

  def close(self) -> None:
    self.flush()
    if self.tensorboard is not None:
      self.tensorboard.close()
    if self.wandb is not None:
      self.wandb.close()
    if self.file is not None:
      self.file.close()
