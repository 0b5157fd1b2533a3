"""elastic_batch: the global batch of a run resumed on another number of devices than its checkpoint was trained on.

keep: the checkpoint's global batch stays; per_device_batch_size becomes global batch / (devices x
gradient_accumulation_steps), so fewer devices each take more sequences. scale: per_device_batch_size stays as
configured, so the global batch grows or shrinks with the device count (and the learning-rate schedule keeps its steps).
"""

from __future__ import annotations

from collections.abc import Callable

from maxtext.config import ConfigError, MaxTextConfig, derived
from maxtext.train import checkpoint_files, checkpointing


def saved_layout(config: MaxTextConfig) -> dict[str, int] | None:
  """The layout the run's newest persistent checkpoint recorded (None: no checkpoint, or one written before layouts were)."""
  newest = checkpoint_files.latest_saved_step(config.checkpoint_dir) if config.enable_checkpointing else None
  if newest is None:
    return None
  from etils import epath

  manifest, _ = checkpointing.read_manifest(epath.Path(newest))
  layout = manifest.get("layout") if manifest else None
  return layout if isinstance(layout, dict) and all(isinstance(layout.get(k), int) for k in ("num_devices", "global_batch_size_to_train_on")) else None


def resume_batch(config: MaxTextConfig, log: Callable[[str], None]) -> MaxTextConfig:
  """config with the batch elastic_batch gives a resume on another device count (unchanged otherwise), with one line saying so."""
  layout = saved_layout(config)
  if layout is None or layout["num_devices"] == config.num_devices:
    return config
  saved, devices = layout["global_batch_size_to_train_on"], config.num_devices
  where = f"resuming on {devices} devices a checkpoint trained on {layout['num_devices']}"
  if config.elastic_batch == "scale" or saved == config.global_batch_size_to_train_on:
    log(f"{where}: the global batch is {config.global_batch_size_to_train_on} sequences (checkpoint: {saved}; elastic_batch={config.elastic_batch})")
    return config
  accumulation = config.gradient_accumulation_steps
  if saved % accumulation:
    raise ConfigError(
      f"elastic_batch=keep: the checkpoint's global batch of {saved} sequences is not a multiple of gradient_accumulation_steps "
      f"{accumulation}; resume with the gradient_accumulation_steps it was trained with, or pass elastic_batch=scale"
    )
  per_device = saved / accumulation / devices
  user = config.model_copy(update={"per_device_batch_size": per_device, **_pipeline_user_values(config)})
  try:
    updated = user.model_copy(update=derived.compute(user, num_devices=devices, num_slices=config.num_slices))
  except ConfigError as e:
    raise ConfigError(f"elastic_batch=keep: per_device_batch_size {per_device:g} for the checkpoint's global batch of {saved} sequences: {e}") from None
  log(f"{where}: elastic_batch=keep holds the global batch at {saved} sequences (per_device_batch_size {config.per_device_batch_size:g} -> {per_device:g})")
  return updated


def _pipeline_user_values(config: MaxTextConfig) -> dict[str, int]:
  """Without pipeline stages, derivation set the pipeline keys to 1 from their -1 defaults: back to what the user had,
  so the config derives again (with stages, the resolved values derive to themselves)."""
  axes = list(config.mesh_axes)
  stages = config.ici_parallelism[axes.index("stage")] * config.dcn_parallelism[axes.index("stage")] if "stage" in axes else 1
  return {"num_pipeline_microbatches": -1, "num_pipeline_repeats": -1} if stages == 1 else {}
