"""The training loop: restore or init, step, log one step late, evaluate, checkpoint, stop cleanly."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from maxtext import memory_limit
from maxtext.config import MaxTextConfig
from maxtext.data.mixture import data_metrics
from maxtext.distributed import all_processes_agree
from maxtext.errors import UserError
from maxtext.models import pipeline, pipeline_specs
from maxtext.train import (
  checkpoint_files,
  checkpointing,
  diloco,
  elastic,
  goodput,
  initial_params,
  local_checkpoints,
  outputs,
  preflight,
  reference,
  run_lock,
  run_report,
)
from maxtext.train import setup as setup_lib
from maxtext.train import state as state_lib
from maxtext.train.metrics import MetricsWriter, format_line
from maxtext.train.preemption import Preemption
from maxtext.train.run_report import RunReport


class NonFiniteLossError(UserError):
  """The loss became NaN or infinite; training stopped before saving the bad state."""

  exit_code = 3


@dataclasses.dataclass
class TrainResult:
  steps_done: int  # optimizer steps in the final state
  losses: dict[int, float]  # step index -> train loss, for the steps this process ran
  eval_losses: dict[int, float]
  stop_reason: str  # 'completed', 'target_eval_loss', 'data_used_up', 'sigterm', 'sigint', 'nothing_to_train'
  state: Any = None


def create_data_iterator(config: MaxTextConfig, mesh: jax.sharding.Mesh, split: str) -> Any:
  """The data pipeline's iterator for `split` (synthetic data included)."""
  from maxtext.data import create_iterator

  return create_iterator(config, mesh, split=split)


def restore_or_init(
  setup: setup_lib.TrainSetup,
  ckpt: checkpointing.Checkpointer | None,
  data_iter: Any,
  log: Callable[[str], None],
  formats: Any = None,
  local: local_checkpoints.LocalTier | None = None,
) -> Any:
  """The run's own latest checkpoint (with data_iter moved to its data position), else load_parameters_path /
  load_full_state_path, else a fresh init. data_iter None: the data position is not restored (nor checked).

  formats: the compiled step's state formats; the state comes back in them (restored arrays are moved there).
  local: the local checkpoint tier, whose newest complete step wins when it is newer than the newest persistent one.
  """
  state = _restore_or_init(setup, ckpt, data_iter, log, formats, local)
  return state if formats is None else state_lib.placed(state, formats)


def _restore_or_init(
  setup: setup_lib.TrainSetup,
  ckpt: checkpointing.Checkpointer | None,
  data_iter: Any,
  log: Callable[[str], None],
  formats: Any,
  local: local_checkpoints.LocalTier | None = None,
) -> Any:
  config = setup.config
  if ckpt is not None and local is not None:
    state = local_checkpoints.restore_newer(local, setup.abstract_state, config, ckpt, data_iter, log)
    if state is not None:
      return _with_frozen_base(setup, state, log, formats)
  if ckpt is not None:
    restored = ckpt.restore_latest(state_lib.checkpointed(setup.abstract_state, config), log, data_iter)
    if restored is not None:
      step = int(restored.state["step"])
      tier = "persistent storage " if local is not None else ""
      log(f"restored checkpoint at step {step} from {tier}{ckpt.config.checkpoint_dir}")  # the run's own (setup may be another's)
      warning = checkpointing.schedule_warning(config, restored.schedule_steps, step, ckpt.directory)
      if warning:
        log(warning)
      return _with_frozen_base(setup, restored.state, log, formats)
  if config.load_full_state_path:
    state = checkpointing.restore_full_state(
      config.load_full_state_path, pipeline.to_storage(state_lib.checkpointed(setup.abstract_state, config), pipeline_specs.pipeline(config))
    )
    state = pipeline.from_storage(state, pipeline_specs.pipeline(config))
    log(f"loaded full state at step {int(state['step'])} from {config.load_full_state_path}")
    return _with_frozen_base(setup, state, log, formats)
  state = setup.init_state(formats)
  state["params"] = initial_params.load_initial_params(config, state["params"], setup.abstract_state["params"], log)
  if config.enable_diloco and config.load_parameters_path:  # the groups start from the loaded parameters
    state = diloco.restart_groups(state, formats or setup.state_shardings)
  return reference.attach_after_load(config, state)


def _with_frozen_base(setup: setup_lib.TrainSetup, state: Any, log: Callable[[str], None], formats: Any) -> Any:
  """A LoRA checkpoint holds only the trainable parameters: add the frozen base (load_parameters_path or the seeded init).
  A DPO/GRPO checkpoint leaves out the frozen reference: rebuild it."""
  state = reference.attach_on_restore(setup, state, log)
  if not setup.config.lora.enable_lora:
    return state
  base = initial_params.load_initial_params(setup.config, setup.init_state(formats)["params"], setup.abstract_state["params"], log, adapters=False)
  return dict(state, params=checkpoint_files.overlay_params(base, state["params"]))


class _Profiler:
  def __init__(self, config: MaxTextConfig, start_step: int):
    self.enabled = config.profiler == "xplane" and jax.process_index() == 0
    self.first = start_step + config.skip_first_n_steps_for_profiler
    self.last = self.first + config.profiler_steps
    self.dir = config.tensorboard_dir
    self.active = False

  def before_step(self, step: int, state: Any) -> None:
    if not self.enabled:
      return
    if step == self.first:
      jax.block_until_ready(state)
      jax.profiler.start_trace(self.dir)
      self.active = True
    elif step == self.last and self.active:
      self.stop(state)

  def stop(self, state: Any) -> None:
    if self.active:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active = False


def eval_batches(it: Any, limit: int) -> Any:
  """Batches while every process still has one (at most limit when > 0): hosts whose eval shares
  pack into different numbers of batches all stop together instead of waiting on each other."""
  i = 0
  while limit <= 0 or i < limit:
    batch = next(it, None)
    if not all_processes_agree(batch is not None):
      return
    yield batch
    i += 1


def _evaluate(config: MaxTextConfig, setup: setup_lib.TrainSetup, state: Any, interrupted: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
  """Eval metrics over the eval split, or None when interrupted() turns true between batches (a preemption)."""
  it = create_data_iterator(config, setup.mesh, "eval")
  sums = []
  for batch in eval_batches(it, config.eval_steps):
    if interrupted():
      preflight.close_iterator(it)
      return None
    sums.append(setup.eval_on(state, batch))
  return setup.objective.combine_eval(jax.device_get(sums))


def log_main(message: str) -> None:
  """Print on process 0 (before the metrics writer exists)."""
  if jax.process_index() == 0:
    print(message, flush=True)


def train(
  config: MaxTextConfig,
  mesh: jax.sharding.Mesh | None = None,
  setup: setup_lib.TrainSetup | None = None,
  on_step: Callable[[int], None] | None = None,
  ends_process: bool = False,
) -> TrainResult:
  """Train to config.steps, or until num_epoch passes over the training data are used up (a normal end: the last
  step is saved), or an early stop.

  mesh defaults to all devices. setup: a TrainSetup built for an equivalent config (same model,
  optimizer, schedule and batch) whose compiled step is reused. on_step(step) runs after each step is logged.
  ends_process: the process ends when this returns (the CLI); after a normal return a SIGTERM/SIGINT then exits 0
  at once (maxtext.train.preemption).

  Order: a run whose own checkpoint already reaches config.steps says so in one line and touches nothing; every
  check (preflight) before anything is written; then the run lock; then checkpoints, restore,
  metrics writers and the loop. SIGTERM/SIGINT at any point end in a saved last step (or, before the first
  step, in a clean exit); a full or read-only output ends in a one-line OutputError.
  """
  with Preemption(ends_process) as preemption:
    timing = goodput.Goodput(config.enable_goodput_recording, config.monitor_goodput, config.log_period)  # wall time starts here
    done = checkpoint_files.saved_steps(config.checkpoint_dir)[-1:] if config.enable_checkpointing else []
    if done and done[0] >= config.steps:  # a rerun of a finished run: say so, touch nothing
      log_main(f"checkpoint at step {done[0]} in {config.checkpoint_dir} already reaches steps={config.steps}; nothing to train (raise steps to train further)")
      return TrainResult(done[0], {}, {}, "nothing_to_train")
    config = elastic.resume_batch(config, log_main)  # elastic_batch, when the checkpoint was trained on another device count
    harness = None  # eval_harness_interval: its tasks are checked here, before anything is compiled or written
    if config.eval_harness_interval > 0:
      from maxtext.integrations.harness_training import TrainingHarness

      harness = TrainingHarness(config)
    with memory_limit.one_line("compiling the train step", preflight.memory_remedy(config)):
      checked = preflight.run_checks(config, mesh, setup, log_main)
    config = checked.config  # remat_policy=auto and decoder_layer_input=auto resolved
    if preemption.requested:
      log_main(f"received {preemption.signal_name} before the first step: stopped, nothing was written; rerun the same command to start")
      return TrainResult(0, {}, {}, preemption.signal_name.lower())
    with run_lock.hold(run_lock.run_dir(config.checkpoint_dir), log_main):
      try:
        with memory_limit.one_line("before the first train step (restoring or initialising the state)", preflight.memory_remedy(config)):
          return _run(config, checked, preemption, on_step, harness, timing)
      except Exception as e:
        error = outputs.as_user_error(e, config.checkpoint_dir, checked.checkpoint_bytes, "a checkpoint or metrics")
        if error is None:
          raise
        raise error from None


def _run(
  config: MaxTextConfig,
  checked: preflight.Checked,
  preemption: Preemption,
  on_step: Callable[[int], None] | None,
  harness: Callable[[Any, Any], dict] | None = None,
  timing: goodput.Goodput | None = None,
) -> TrainResult:
  """Restore or init, then the step loop; runs under the run lock, after every check passed."""
  timing = timing or goodput.Goodput(False, False, config.log_period)
  mesh, setup, data_iter = checked.mesh, checked.setup, checked.data_iter
  ckpt = checkpointing.Checkpointer(config) if config.enable_checkpointing else None
  local = local_checkpoints.LocalTier(config) if ckpt is not None and local_checkpoints.enabled(config) else None
  writer: MetricsWriter | None = None
  failed = True
  try:
    resuming = ckpt is not None and bool(checkpoint_files.saved_steps(config.checkpoint_dir)) or bool(config.load_full_state_path)
    resuming = resuming or (local is not None and local.has_steps())
    with jax.set_mesh(mesh), timing.phase("checkpoint_restore" if resuming else "initialization"):
      state = restore_or_init(setup, ckpt, data_iter, log_main, state_lib.compiled_formats(checked.step_fn), local)
    start = int(state["step"])
    writer = MetricsWriter(config)
    result = _Loop(config, checked, preemption, on_step, ckpt, writer, state, start, harness, timing, local).run()
    failed = False
    return result
  finally:
    for closer in (ckpt, writer):
      if closer is None:
        continue
      try:
        closer.close()
      except Exception:
        if not failed:
          raise


class _Loop:
  """The step loop as named phases: step, log (one step late), checkpoint, eval, preemption and end.

  Holds what the phases share: the state, the run's result, the metrics not yet fetched, the time of the last
  logged step and the newest saved step.
  """

  def __init__(
    self,
    config: MaxTextConfig,
    checked: preflight.Checked,
    preemption: Preemption,
    on_step: Callable[[int], None] | None,
    ckpt: checkpointing.Checkpointer | None,
    writer: MetricsWriter,
    state: Any,
    start: int,
    harness: Callable[[Any, Any], dict] | None = None,
    timing: goodput.Goodput | None = None,
    local: local_checkpoints.LocalTier | None = None,
  ):
    self.timing = timing or goodput.Goodput(False, False, config.log_period)  # where the wall time goes (maxtext.train.goodput)
    self.config, self.checked, self.preemption, self.on_step = config, checked, preemption, on_step
    self.ckpt, self.writer, self.state, self.start = ckpt, writer, state, start
    self.harness = harness  # eval_harness_interval's tasks on the live parameters, or None
    self.story = RunReport(config, checked.mesh, checked.setup.policy, start, writer.log, checked.choice)
    self.result = TrainResult(start, {}, {}, "completed")
    self.pending: list[tuple[int, Any]] = []  # (step index, device metrics) not yet fetched
    self.last_time = 0.0  # perf_counter() when the last logged step (or eval) ended; set when the steps begin
    self.profiler = _Profiler(config, start)
    self.saved = start  # steps done in the newest saved (or restored) checkpoint
    self.local = local  # the local checkpoint tier, when on
    self.last_persistent = time.monotonic()  # when the newest persistent save (or the start) was

  def run(self) -> TrainResult:
    """Banner, the steps, then the end: the final save, the preemption line and the summary."""
    config = self.config
    self.story.banner()
    if config.compiled_trainstep_file:
      self.writer.log(f"loaded the compiled train step from {config.compiled_trainstep_file}")
    if self.preemption.requested:
      self.result.stop_reason = self.preemption.signal_name.lower()
      self.writer.log(
        f"received {self.preemption.signal_name} before the first step: stopped at step {self.start}, nothing new to save; rerun the same command to continue"
      )
      return self.result
    self.last_time = time.perf_counter()
    self.timing.start(run_report.run_dir(config), self.start, self.writer.log)
    in_step = memory_limit.one_line(lambda: f"in train step {self.start + len(self.result.losses)}", preflight.memory_remedy(config))
    with jax.set_mesh(self.checked.mesh), in_step:
      for step in range(self.start, config.steps):
        if not self.step(step) or self.preemption.requested:
          break
        self.checkpoint(step + 1)
        if not self.eval(step):
          break
        self.harness_eval(step)
      self.last_save()
    self.timing.steps_ended()
    self.writer.flush()
    return self.end()

  def step(self, step: int) -> bool:
    """Run one step (GRPO: rollout, scoring and update) and queue its metrics; False when the data is used up."""
    self.profiler.before_step(step, self.state)
    trainer = self.checked.trainer  # GRPO (maxtext.train.grpo): the step is done when it returns
    if trainer is not None:
      done_step = trainer.step(self.state, step, lambda: self.preemption.requested)
    else:
      with self.timing.phase("data_waiting"):
        batch = next(self.checked.data_iter, None)
      done_step = None if batch is None else self.checked.step_fn(self.state, batch)
    if done_step is None:  # num_epoch passes over the data (GRPO: the prompts) are done: a normal end, saved at the end
      # (or a signal stopped a GRPO step in its reward functions: the stop reason becomes the signal's at the end)
      self.result.stop_reason = "data_used_up"
      return False
    self.state, metrics = done_step
    metrics = {**metrics, **data_metrics(self.checked.data_iter)}  # host floats (a mixture's realised fractions), no device sync
    if trainer is None:
      self.log()  # the previous step's metrics, while this step runs
    self.pending.append((step, metrics))
    if trainer is not None:
      self.log()  # already finished: timed without the next step's rollout
    self.result.steps_done = step + 1
    return True

  def log(self, ready: Any = None) -> None:
    """Fetch and write the pending metrics (blocks until that step has finished; `ready`: the state it produced, when no later step runs)."""
    if ready is not None and self.pending:
      jax.block_until_ready(ready)
    while self.pending:
      step, device_metrics = self.pending.pop(0)
      m = diloco.host_metrics(jax.device_get(device_metrics))
      now = time.perf_counter()
      seconds, self.last_time = now - self.last_time, now
      _check_finite(self.config, step, m)
      m.update(self.story.step_metrics(seconds))
      self.result.losses[step] = m["loss"]
      self.writer.write(step, m, format_line(step, m))
      self.story.after_step(step, m)
      self.timing.step_logged(step)
      if self.on_step is not None:
        self.on_step(step)

  def checkpoint(self, done: int) -> None:
    """Save after `done` steps at every checkpoint_period and, with save_checkpoint_on_completion, after the last step;
    else to the local tier at its period (persistently instead once multi_tier_checkpointing_backup_interval_minutes passed)."""
    if done % self.config.checkpoint_period == 0 or (done == self.config.steps and self.config.save_checkpoint_on_completion):
      self.save(done)
    elif self.local is not None and self.local.due(done):
      if local_checkpoints.backup_due(self.config, time.monotonic() - self.last_persistent):
        self.save(done)
      else:
        self.log(self.state)
        self.writer.flush()
        with self.timing.phase("checkpoint_save"):
          self.local.save(done, state_lib.checkpointed(self.state, self.config), self.checked.data_iter.get_state())

  def save(self, steps_done: int) -> None:
    """Log every pending step (a NaN in the step being saved aborts here, before anything is written), then save."""
    self.log(self.state)
    self.writer.flush()  # the metrics file holds every step the checkpoint holds
    if self.ckpt is not None:
      with self.timing.phase("checkpoint_save"):
        self.ckpt.save(steps_done, state_lib.checkpointed(self.state, self.config), self.checked.data_iter.get_state())
        self.saved = steps_done
        self.last_persistent = time.monotonic()

  def eval(self, step: int) -> bool:
    """Evaluate after step every eval_interval steps; False when the run stops (preempted, or target_eval_loss reached)."""
    config, done = self.config, step + 1
    if config.eval_interval <= 0 or done % config.eval_interval != 0:
      return True
    self.log(self.state)
    with memory_limit.one_line(f"in the eval after step {step}", preflight.eval_memory_remedy(config)):
      with self.timing.phase("evaluation"):
        ev = _evaluate(config, self.checked.setup, self.state, lambda: self.preemption.requested)
    if ev is None:
      return False  # preempted during the eval
    self.result.eval_losses[step] = ev["eval_loss"]
    self.story.after_eval(step, ev["eval_loss"])
    self.writer.write(step, ev, f"eval after step {step}: eval_loss: {ev['eval_loss']:.4f}, total_weights: {int(ev['eval_total_weights'])}")
    self.last_time = time.perf_counter()  # eval time is not step time
    if config.target_eval_loss > 0 and ev["eval_loss"] <= config.target_eval_loss:
      self.writer.log(f"eval_loss {ev['eval_loss']:.4f} reached target_eval_loss {config.target_eval_loss}; stopping after step {step}")
      self.result.stop_reason = "target_eval_loss"
      if config.save_checkpoint_on_completion and done != config.steps:
        self.save(done)
      return False
    return True

  def harness_eval(self, step: int) -> None:
    """Every eval_harness_interval steps: the harness tasks on the live parameters, as harness/<task>/<metric> metrics."""
    if self.harness is None or (step + 1) % self.config.eval_harness_interval != 0:
      return
    self.log(self.state)
    with self.timing.phase("evaluation"):
      scores = self.harness(self.state, self.checked.setup)
    self.writer.write(step, scores, f"harness after step {step}: " + ", ".join(f"{k.removeprefix('harness/')}: {v:.4f}" for k, v in scores.items()))
    self.last_time = time.perf_counter()  # harness time is not step time

  def last_save(self) -> None:
    """Log the last step, stop the profiler, save the last step after a preemption or used-up data, wait for the saves."""
    self.log(self.state)
    self.profiler.stop(self.state)
    if self.ckpt is None:
      return
    data_end = self.result.stop_reason == "data_used_up" and self.config.save_checkpoint_on_completion
    if (self.preemption.requested or data_end) and self.saved != self.result.steps_done:
      self.save(self.result.steps_done)
    with self.timing.phase("checkpoint_save"):
      self.ckpt.wait()  # a signal now waits for the final save to finish

  def preempted(self) -> None:
    """After SIGTERM/SIGINT: the stop reason, and one line saying what was saved."""
    self.result.stop_reason = self.preemption.signal_name.lower()
    where = (
      f"saved a checkpoint after step {self.result.steps_done - 1} in {self.config.checkpoint_dir}"
      if self.ckpt is not None and self.result.steps_done > self.start
      else f"stopped during step {self.start}, nothing new to save"
      if self.result.steps_done == self.start
      else "stopped (enable_checkpointing=false: nothing saved)"
    )
    self.writer.log(f"received {self.preemption.signal_name}: {where}; rerun the same command to continue")

  def end(self) -> TrainResult:
    """The preemption line (when a signal stopped the run), the summary, and the result."""
    result = self.result
    if self.preemption.requested:
      self.preempted()
    result.state = self.state
    self.story.summary(result.steps_done, result.stop_reason)
    self.timing.finish()
    return result


def _check_finite(config: MaxTextConfig, step: int, m: dict[str, float]) -> None:
  for key in ("loss", "grad_norm"):
    value = m[key]
    if (config.abort_on_nan_loss and math.isnan(value)) or (config.abort_on_inf_loss and math.isinf(value)):
      raise NonFiniteLossError(f"{key} is {value} at step {step}; training stopped and this state was not saved (lower learning_rate or check the data)")
