"""The run's story on stdout: a banner of what runs where, progress with an ETA every log_period steps, a closing
summary (wall time, tokens, final losses, mean throughput and MFU, checkpoint, plot, how to resume).

The loop calls `RunReport` at four points (start, each logged step, each eval, the end); the per-step line in
MaxText's format stays the loop's own (maxtext.train.metrics.format_line).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax

from maxtext.aot import remat_auto
from maxtext.config import MaxTextConfig
from maxtext.layers.quantization import Recipe
from maxtext.models import pipeline, pipeline_specs
from maxtext.platform import Policy, keyed_moe_dispatch
from maxtext.train import checkpoint_files, perf


def duration(seconds: float) -> str:
  """'42s', '3m07s', '2h05m'."""
  seconds = max(0, round(seconds))
  if seconds < 60:
    return f"{seconds}s"
  if seconds < 3600:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def count(n: float) -> str:
  """'10.2M', '8.19K', '512'."""
  for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= size:
      return f"{n / size:.3g}{unit}"
  return f"{n:.0f}"


def quantization_summary(r: Recipe, platform: str) -> str:
  """One line on what a quantization recipe does on this platform (the train banner's)."""
  formats = f"weights {r.weight}" + (f", activations {r.activation}" if r.activation else "") + f", gradients {r.gradient or 'straight-through'}"
  where = "kernels stored quantized (frozen base)" if r.stored else "kernels quantized from float each step"
  units = f"the {platform}'s matmul units take {r.weight}" if r.native else f"XLA converts {r.weight} to bf16 on {platform} (no speedup)"
  return f"{r.mode} ({formats}); {where}; {units}"


def run_dir(config: MaxTextConfig) -> str:
  """<base_output_directory>/<run_name>, as the config resolved it (the parent of checkpoint_dir)."""
  return os.path.dirname(os.path.dirname(config.checkpoint_dir))


def continuation(config: MaxTextConfig, checkpoint: str) -> str:
  """The keys to add to a run's command to start a new run from its last state (load_full_state_path). A LoRA run
  keeps its load_parameters_path (the frozen base under the state's adapters); any other run clears one the config
  sets (e.g. a converted model's YAML), since it starts from one of the two."""
  keys = f"run_name=<new name> load_full_state_path={checkpoint}/{checkpoint_files.ITEM}"
  return f"{keys} load_parameters_path=" if config.load_parameters_path and not config.lora.enable_lora else keys


class RunReport:
  """Prints the banner, the progress lines and the summary of one call of maxtext.train.loop.train."""

  def __init__(
    self,
    config: MaxTextConfig,
    mesh: jax.sharding.Mesh,
    policy: Policy,
    start_step: int,
    log: Callable[[str], None],
    choice: remat_auto.Choice | None = None,
  ):
    from maxtext import counting

    self.config, self.mesh, self.policy, self.start, self.log = config, mesh, policy, start_step, log
    self.choice = choice  # how remat_policy=auto / decoder_layer_input=auto were resolved, if they were
    self.began = time.perf_counter()
    self.flops = counting.flops_per_device_per_step(config) / 1e12  # TFLOPs per device per step
    self.tokens_per_step = config.global_batch_size_to_train_on * config.max_target_length
    self.yardstick = perf.Yardstick.of(config)
    self.step_seconds: list[float] = []  # this process's logged steps, in order
    self.step_mfu: list[float] = []
    self.first_done: float | None = None  # wall clock when the first step of this process finished (after compiling)
    self.last_loss: tuple[int, float] | None = None
    self.last_eval: tuple[int, float] | None = None

  def banner(self) -> None:
    from maxtext import counting

    c = self.config
    model = c.model_name if c.model_name != "default" else f"{c.decoder_block} (configured in YAML)"
    params = counting.param_count(c)
    mesh = " x ".join(f"{axis} {size}" for axis, size in self.mesh.shape.items())
    tensorboard = f"tensorboard --logdir {c.tensorboard_dir}" if c.enable_tensorboard else "off (enable_tensorboard=false)"
    self.log(f"model: {model}, {count(params)} parameters ({c.num_decoder_layers} layers, emb {c.emb_dim}, {c.num_query_heads} heads, vocab {c.vocab_size})")
    self.log(f"mesh: {mesh} over {self.mesh.devices.size} {self.policy.platform} device(s) in {jax.process_count()} process(es)")
    self.log(
      f"batch: {c.global_batch_size_to_train_on} sequences x {c.max_target_length} tokens = {self.tokens_per_step:,} tokens per step"
      + (f" ({c.gradient_accumulation_steps} accumulated micro-batches)" if c.gradient_accumulation_steps > 1 else "")
    )
    if c.num_experts > 1:
      capacity = f"capacity_factor {c.capacity_factor}" if c.capacity_factor > 0 else "dropless"
      if c.ragged_buffer_factor > 0:
        capacity += f", ragged_buffer_factor {c.ragged_buffer_factor} (expert-parallel receive buffers; rows past them dropped)"
      keyed = keyed_moe_dispatch(c, self.policy.platform)
      forced = f" (quantization: {keyed} takes no quantized operands)" if keyed != self.policy.moe_dispatch else ""
      self.log(f"experts: {c.num_experts}, top {c.num_experts_per_tok}, {capacity}; dispatch {self.policy.moe_dispatch}{forced} (docs/models.md, MoE dispatch)")
    pipelined = pipeline.banner(pipeline_specs.pipeline_plan(c))
    if pipelined:
      self.log(pipelined)
    if c.remat_policy != "none":
      remat = f"{c.remat_policy} (remat_policy=auto)" if self.choice and self.choice.auto_policy else c.remat_policy
      self.log(f"remat: {remat}; {remat_auto.saved_input(self.policy.offload_layer_inputs, c.decoder_layer_input, self.choice)}")
    if self.policy.quantization is not None:
      self.log(f"quantization: {quantization_summary(self.policy.quantization, self.policy.platform)}")
    self.log(f"output: {run_dir(c)}; TensorBoard: {tensorboard}")
    self.log(
      f"training {c.run_name} from step {self.start} to {c.steps}; MFU against {self.yardstick.tflops:.3f} TFLOP/s/device ({self.yardstick.described()})"
    )

  def step_metrics(self, seconds: float) -> dict[str, float]:
    """Throughput and MFU of a step that took `seconds` (measured once its results were ready)."""
    tflops = self.flops / seconds
    mfu = self.yardstick.mfu(tflops)
    raised = self.yardstick.take_note()
    if raised:
      self.log(raised)
    self.step_seconds.append(seconds)
    self.step_mfu.append(mfu)
    return {
      "seconds": seconds,
      "tflops_per_device": tflops,
      "tokens_per_device": self.tokens_per_step / self.config.num_devices / seconds,
      "mfu": mfu,
    }

  def after_step(self, step: int, m: dict[str, float]) -> None:
    """Remember the loss; every log_period steps print the share of steps done and the ETA."""
    now = time.perf_counter()
    self.last_loss = (step, m["loss"])
    done, total = step + 1, self.config.steps
    if self.first_done is None:
      self.first_done = now
    if done % self.config.log_period or done >= total:
      return
    ran = len(self.step_seconds)
    # Wall time per step since the first step (compilation excluded; evals and checkpoints included).
    per_step = (now - self.first_done) / (ran - 1) if ran > 1 else self.step_seconds[-1]
    self.log(
      f"progress: {done}/{total} steps ({100 * done / total:.0f}%), {duration(now - self.began)} elapsed, "
      f"ETA {duration(per_step * (total - done))} at {per_step:.3f} s/step"
    )

  def after_eval(self, step: int, eval_loss: float) -> None:
    self.last_eval = (step, eval_loss)

  def summary(self, steps_done: int, stop_reason: str) -> None:
    """The closing lines; also writes the run's training-curve PNG (process 0)."""
    c = self.config
    ran = steps_done - self.start
    epochs = f"{c.num_epoch} epoch{'s' if c.num_epoch != 1 else ''}"
    why = f"data used up after {epochs} at step {steps_done}; " if stop_reason == "data_used_up" else ""
    how = {
      "completed": "completed",
      "target_eval_loss": "stopped at target_eval_loss",
      "data_used_up": "ended",
      "sigterm": "stopped by SIGTERM",
      "sigint": "stopped by SIGINT",
    }.get(stop_reason, stop_reason)
    self.log(
      f"run {c.run_name} {how} in {duration(time.perf_counter() - self.began)}: {why}steps {self.start} -> {steps_done}, "
      f"{count(ran * self.tokens_per_step)} tokens this run"
    )
    losses = []
    if self.last_loss is not None:
      losses.append(f"final train loss {self.last_loss[1]:.4f} (step {self.last_loss[0]})")
    if self.last_eval is not None:
      losses.append(f"eval loss {self.last_eval[1]:.4f} (after step {self.last_eval[0]})")
    if losses:
      self.log("; ".join(losses))
    timed = self.step_seconds[1:] or self.step_seconds  # the first step of a process includes compilation
    if timed:
      mean_seconds = sum(timed) / len(timed)
      mfu = self.flops / mean_seconds / self.yardstick.tflops
      self.log(
        f"mean {self.tokens_per_step / c.num_devices / mean_seconds:,.0f} tokens/s/device, {self.flops / mean_seconds:.3f} TFLOP/s/device, "
        f"MFU {100 * mfu:.2f}% of {self.yardstick.tflops:.3f} TFLOP/s ({self.yardstick.source}) over {len(timed)} steps"
      )
    checkpoint = checkpoint_files.latest_saved_step(c.checkpoint_dir) if c.enable_checkpointing else None
    self.log(f"checkpoint: {checkpoint}" if checkpoint else "checkpoint: none saved (enable_checkpointing=false or no checkpoint step reached)")
    png = self._write_plot()
    if png:
      self.log(f"plot: {png}")
    if checkpoint and stop_reason == "data_used_up":
      self.log(
        f"resume: the data is used up, so rerunning this command trains nothing; to train further, start a new run from the last state: "
        f"{continuation(c, checkpoint)} (its data starts from the beginning)"
      )
    elif checkpoint:
      self.log("resume: rerun the same command; it continues from the latest checkpoint (raise steps= to train further)")

  def _write_plot(self) -> str | None:
    if jax.process_index() != 0 or not self.config.enable_tensorboard:
      return None
    from maxtext import plot

    directory = run_dir(self.config)
    try:
      return plot.write([directory], os.path.join(directory, plot.RUN_PNG))
    except Exception as e:  # a plot must never fail a finished run
      self.log(f"plot: not written ({type(e).__name__}: {e})")
      return None
