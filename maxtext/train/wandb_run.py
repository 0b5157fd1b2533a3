"""Weights & Biases for a training run (enable_wandb, process 0): the metrics TensorBoard gets, under the same names,
the resolved config as the run config, and the training-curves PNG when the run ends.

The W&B run id is kept in `<run dir>/wandb_run_id`, so a resumed run (the same command again) appends to the same
W&B run. W&B's own files go to `<run dir>/wandb/` unless WANDB_DIR says otherwise; WANDB_MODE=offline keeps them
local (upload them later with `wandb sync`).
"""

from __future__ import annotations

import math
import os
import secrets
import string
import time

from etils import epath

from maxtext.config import MaxTextConfig
from maxtext.errors import UserError
from maxtext.plot import RUN_PNG
from maxtext.train import outputs
from maxtext.train.run_report import run_dir

ID_FILE = "wandb_run_id"
PNG_KEY = "training_curves"


class WandbRun:
  """One W&B run; log() hands metrics to W&B's background process (no waiting on the network or the device)."""

  def __init__(self, config: MaxTextConfig, tag: str = "learning/{}"):
    import wandb

    self._wandb = wandb
    self.tag = tag
    self.directory = run_dir(config)
    run_id = _read_or_make_id(self.directory)
    local = None if os.environ.get("WANDB_DIR") or outputs.is_remote(self.directory) else self.directory
    self.started = time.time()
    try:
      self.run = wandb.init(
        project=config.wandb_project_name,
        name=config.wandb_run_name or config.run_name,
        id=run_id,
        resume="allow",
        config=config.model_dump(mode="json"),
        dir=local,
      )
    except Exception as e:  # noqa: BLE001 - wandb raises many types (no login, no network, bad project)
      first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
      raise UserError(
        f"Weights & Biases could not start run {run_id} ({type(e).__name__}: {first}); run `wandb login`, set WANDB_MODE=offline, or set enable_wandb=false"
      ) from None

  def log(self, step: int, metrics: dict[str, float]) -> None:
    values = {self.tag.format(k): v for k, v in metrics.items() if math.isfinite(v)}
    if values:
      self.run.log(values, step=step)

  def close(self) -> None:
    """Log the training-curves PNG the run wrote (if it wrote one) and finish the W&B run."""
    png = os.path.join(self.directory, RUN_PNG)
    if not outputs.is_remote(png) and os.path.isfile(png) and os.path.getmtime(png) >= self.started:
      self.run.log({PNG_KEY: self._wandb.Image(png)})
    self.run.finish()


def new_run_id() -> str:
  """A fresh W&B run id: 8 lowercase letters and digits, as W&B makes them."""
  return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _read_or_make_id(directory: str) -> str:
  """The run's W&B id from <run dir>/wandb_run_id, written there first if the run has none yet."""
  path = epath.Path(directory) / ID_FILE
  if path.exists():
    run_id = path.read_text().strip()
    if run_id:
      return run_id
  run_id = new_run_id()
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(run_id + "\n")
  return run_id
