"""eval_harness_interval: lm-evaluation-harness tasks on the train state's live parameters every N steps of training.

The tasks are checked before training writes anything (an unknown task is a ConfigError); each run wraps the current
parameter arrays in a model (no copy beyond decode's per-layer one on CPU) and returns flat metrics,
`harness/<task>/<metric>`, for the metrics writer.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError


class TrainingHarness:
  """Runs config.eval_harness_tasks on a train state; made (and the tasks checked) before the train step compiles."""

  def __init__(self, config: MaxTextConfig):
    from maxtext.integrations import require_lm_eval

    if not config.eval_harness_tasks:
      raise ConfigError(
        f"eval_harness_interval={config.eval_harness_interval} needs the tasks to run; set eval_harness_tasks=[task,...] or eval_harness_interval=-1"
      )
    require_lm_eval()
    from maxtext.data.pipeline import resolve_tokenizer
    from maxtext.integrations.lm_eval_backend import task_manager, unknown_tasks

    unknown_tasks(config.eval_harness_tasks, config.eval_harness_include_path)
    self.config = config
    self.tasks = task_manager(config.eval_harness_include_path or None)
    self.tokenizer = resolve_tokenizer(config)
    self.lm: Any = None  # the backend, made at the first run

  def __call__(self, state: dict[str, Any], setup: Any) -> dict[str, float]:
    """{'harness/<task>/<metric>': value} of the tasks on state's parameters (setup: the run's TrainSetup, for the
    model's graph and mesh; stderr values left out)."""
    from lm_eval import simple_evaluate

    from maxtext.integrations.lm_eval_backend import MaxTextLM

    model = nnx.merge(setup.graphdef, state["params"], state.get("other", nnx.State({})))
    if self.lm is None:
      self.lm = MaxTextLM(model, self.tokenizer, maxtext_config=self.config, batch_size=self.config.global_batch_size_to_eval_on, mesh=setup.mesh)
    else:
      self.lm.load_parameters(model)  # the compiled scorer and decoders are reused
    results = simple_evaluate(model=self.lm, tasks=list(self.config.eval_harness_tasks), task_manager=self.tasks)
    return {
      f"harness/{task}/{name.split(',')[0]}": float(value)
      for task, metrics in results["results"].items()
      for name, value in metrics.items()
      if isinstance(value, (int, float)) and "_stderr" not in name and name != "sample_len"
    }
