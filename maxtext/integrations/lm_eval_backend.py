"""maxtext as an lm-evaluation-harness model (lm_eval's `LM` API), registered as `maxtext`.

`MaxTextLM(model, tokenizer, maxtext_config=config)` wraps a loaded model; `MaxTextLM(config=<yml>, key=value, ...)` (what the harness builds
from `--model_args`) loads one the way `maxtext.decode` does: hf_model_path, load_parameters_path or the run's own
checkpoint, with the model's tokenizer. Requests follow the harness's `hf` backend token for token (BOS handling,
left truncation to max_length, the rolling windows, stop sequences), so scores and greedy generations agree with it:

- loglikelihood: right-padded rows of (context + continuation)[:-1], batch_size rows per jitted forward pass, lengths
  padded to a power-of-two bucket; requests whose rows are equal (multiple choice with one-token answers) share one row.
- loglikelihood_rolling: the harness's disjoint rolling windows of max_length tokens, scored like loglikelihood.
- generate_until: the KV-cache Generator (maxtext.inference), greedy unless the task's gen_kwargs sample; stop
  sequences cut the decoded text, EOS ends a row.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  (the harness registers its own backends lazily only while the registry is empty)
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from maxtext import mesh as mesh_lib
from maxtext.config import MaxTextConfig
from maxtext.errors import ConfigError, DataError
from maxtext.inference import unstack
from maxtext.inference.generate import MIN_BUCKET, Generator, check_tokenizer, prefill_bucket
from maxtext.inference.sampling import SamplingParams
from maxtext.models.decoder import Transformer

DEFAULT_MAX_GEN_TOKS = 256  # the hf backend's default when a task sets no max_gen_toks


def load(argv: Sequence[str]) -> tuple[Transformer, MaxTextConfig, Any, Any]:
  """(model, its config, tokenizer, mesh) for `<config.yml> key=value ...`, loaded and checked as `maxtext.decode` does."""
  from maxtext.config import load as load_config
  from maxtext.inference.cli import check_training_only_axes
  from maxtext.inference.loading import hf_config, load_decode_tokenizer, load_model

  config = load_config(argv)
  check_training_only_axes(config)
  if config.hf_model_path:
    config = hf_config(argv, config.hf_model_path)
  tokenizer = load_decode_tokenizer(config)
  mesh = mesh_lib.create(config)
  return load_model(config, mesh, log=lambda m: None), config, tokenizer, mesh


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None = None) -> Any:
  """The harness's TaskManager (its own tasks plus include_path's), indexed once per process: indexing reads
  thousands of YAML files."""
  from lm_eval.tasks import TaskManager

  return TaskManager(include_path=include_path or None)


def unknown_tasks(tasks: Sequence[str], include_path: str) -> None:
  """A ConfigError naming the tasks the harness does not know (before any model is loaded)."""
  missing = [t for t in tasks if not task_manager(include_path or None).match_tasks([t])]
  if missing:
    where = f" or in {include_path}" if include_path else ""
    raise ConfigError(
      f"unknown harness task(s) {', '.join(missing)}: not among the harness's tasks{where}; fix eval_harness_tasks or set eval_harness_include_path"
    )


def _config_argv(config: str | None, keys: dict[str, Any]) -> list[str]:
  """model_args -> [<config.yml>, key=value, ...] (the harness has already turned 'true', '3', '1e-3' into values)."""
  from maxtext.config.model_file import PACKAGE_CONFIG_DIR

  def text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)

  return [str(config or PACKAGE_CONFIG_DIR / "base.yml"), *(f"{k}={text(v)}" for k, v in keys.items())]


def _batch_size(value: Any) -> int:
  try:
    size = int(value)
  except (TypeError, ValueError):
    size = 0
  if size < 1:
    raise ConfigError(
      f"batch_size {value!r} is not supported by the maxtext backend (it does not tune batch sizes); pass a whole number >= 1, e.g. --batch_size 8"
    )
  return size


def _score_rows(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, targets: jax.Array, last: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """tokens, targets [B, S] -> (log p(target) [B, S], target is the argmax [B, S], log-probs at position last[b] [B, V])."""
  logp = jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens).astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  greedy = jnp.argmax(logp, axis=-1) == targets
  final = jnp.take_along_axis(logp, last[:, None, None], axis=1)[:, 0]
  return picked, greedy, final


@register_model("maxtext")
class MaxTextLM(TemplateLM):
  """An lm-evaluation-harness model backed by a maxtext Transformer and its tokenizer.

  model, tokenizer, maxtext_config: a loaded model and its config (e.g. maxtext.from_hf's pair) and a maxtext tokenizer; or config (a YAML file, default
  the package's base.yml) and maxtext config keys, loaded as maxtext.decode loads them. batch_size: rows per forward
  pass and per generation batch. max_length: most tokens a scored row or a prompt plus its generation holds (default
  the config's max_target_length). device: the harness's torch device option; JAX places the model (JAX_PLATFORMS).
  """

  def __init__(
    self,
    model: Transformer | None = None,
    tokenizer: Any = None,
    *,
    maxtext_config: MaxTextConfig | None = None,
    config: str | None = None,
    batch_size: int | str = 1,
    max_batch_size: int | None = None,
    max_length: int | None = None,
    device: str | None = None,
    mesh: Any = None,
    **config_keys: Any,
  ):
    super().__init__()
    if max_batch_size is not None:
      raise ConfigError("max_batch_size bounds the harness's batch_size=auto search, which the maxtext backend does not run; drop it and set --batch_size")
    self._batch = _batch_size(batch_size)
    if model is None:
      model, maxtext_config, tokenizer, mesh = load(_config_argv(config, config_keys))
    elif config is not None or config_keys:
      raise ConfigError(f"pass either a loaded model or config keys, not both (got {sorted([*config_keys, *(['config'] if config else [])])})")
    if tokenizer is None:
      raise ConfigError("MaxTextLM(model=...) needs the model's tokenizer (maxtext.tokenizer.load_tokenizer)")
    if maxtext_config is None:
      raise ConfigError("MaxTextLM(model=...) needs the model's config (maxtext_config=, as maxtext.from_hf returns it)")
    c = maxtext_config
    check_tokenizer(tokenizer, c.vocab_size)
    self.model = unstack.for_decoding(model)
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.maxtext_config = c
    self._max_length = int(max_length or c.max_target_length)
    if self._max_length < 2:
      raise ConfigError(f"max_length {self._max_length} leaves no room to score a token; raise max_length or max_target_length")
    self._graphdef, self._state = nnx.split(self.model)
    self._score = jax.jit(functools.partial(_score_rows, self._graphdef))
    self._generators: dict[tuple[int, int, SamplingParams], Generator] = {}
    self._rows = -(-self._batch // self._batch_multiple()) * self._batch_multiple()
    self._bos_text = tokenizer.special_tokens.get("bos_token") or None

  def load_parameters(self, model: Transformer) -> None:
    """Score and generate with model's parameters from now on (the same structure: the compiled functions are kept)."""
    self.model = unstack.for_decoding(model)
    self._state = nnx.split(self.model)[1]

  # -- what the harness asks of a model ----------------------------------------------------------------------
  @property
  def eot_token_id(self) -> int:
    if self.tokenizer.eos_id is None:
      raise DataError(f"tokenizer '{self.tokenizer.path}' has no EOS token; the harness needs one (use a tokenizer that defines it)")
    return self.tokenizer.eos_id

  @property
  def prefix_token_id(self) -> int:
    """What an empty context and each rolling window start from: BOS, else EOS (as the hf backend)."""
    return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def batch_size(self) -> int:
    return self._batch

  @property
  def tokenizer_name(self) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "__", str(self.tokenizer.path))

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
    """Token ids, with BOS first when add_special_tokens (default: the config's add_bos) and the text does not start
    with the BOS token's text already."""
    add = self.maxtext_config.add_bos if add_special_tokens is None else add_special_tokens
    if add_special_tokens is None and self._bos_text and string.startswith(self._bos_text):
      add = False
    bos = [self.tokenizer.bos_id] if add and self.tokenizer.bos_id is not None else []
    return bos + self.tokenizer.encode(string)

  def tok_decode(self, tokens: Sequence[int]) -> str:
    """Text of tokens, special tokens (BOS, EOS, and a Hugging Face tokenizer's others) left out."""
    special = {self.tokenizer.bos_id, self.tokenizer.eos_id, *getattr(getattr(self.tokenizer, "_tok", None), "all_special_ids", ())}
    return self.tokenizer.decode([t for t in tokens if t not in special])

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    """The template: chat_template or chat_template_path from the config, else the tokenizer's own; None when off."""
    if chat_template is False or chat_template is None:
      return None
    from maxtext.data.sft import resolve_chat_template

    c = self.maxtext_config
    template = resolve_chat_template(c.chat_template, c.chat_template_path, self.tokenizer.chat_template)
    if template is None:
      raise ConfigError(
        f"--apply_chat_template: tokenizer '{self.tokenizer.path}' has no chat template; set chat_template or chat_template_path in --model_args"
      )
    return template

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The conversation rendered with the chat template (as transformers renders it); without a generation prompt the
    text ends with the last message's content, so the model continues it."""
    import jinja2

    from maxtext.data.sft import compile_template

    template = compile_template(self.chat_template(True))
    try:
      text = template.render(messages=chat_history, add_generation_prompt=add_generation_prompt, **self.tokenizer.special_tokens)
    except jinja2.exceptions.TemplateError:  # as the hf backend: retry without a system turn the template refuses
      chat_history = [m for m in chat_history if m["role"] != "system"]
      text = template.render(messages=chat_history, add_generation_prompt=add_generation_prompt, **self.tokenizer.special_tokens)
    if not add_generation_prompt and chat_history:
      last = chat_history[-1]["content"].strip()
      if last and last in text:
        text = text[: text.rindex(last) + len(last)]
    return text

  # -- log-likelihoods -------------------------------------------------------------------------------------
  def _batch_multiple(self) -> int:
    if self.mesh is None:
      return 1
    spec = mesh_lib.logical_to_spec(("activation_batch",), self.maxtext_config.logical_axis_rules, self.mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return int(np.prod([self.mesh.shape[a] for a in axes]))

  def _mesh_context(self):
    import contextlib

    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
    """(request, context tokens, continuation tokens) -> (log p(continuation | context), continuation is greedy)."""
    rows: dict[tuple[int, ...], int] = {}  # input tokens -> row index: equal inputs share a row
    inputs: list[list[int]] = []
    targets: list[list[int]] = []
    plan = []  # per request: (row, continuation length, its last token)
    for _, context, continuation in requests:
      if not continuation:
        raise DataError("a loglikelihood request has an empty continuation; the task must give each request text to score")
      whole = (context + continuation)[-(self._max_length + 1) :]
      key = tuple(whole[:-1])
      if key not in rows:
        rows[key] = len(inputs)
        inputs.append(whole[:-1])
        targets.append(whole[1:])
      plan.append((rows[key], min(len(continuation), len(whole) - 1), continuation[-1]))
    picked, greedy, final = self._score_all(inputs, targets)
    out = []
    for row, n, last_token in plan:
      length = len(inputs[row])
      span = slice(length - n, length - 1)  # the continuation's tokens but its last, which final[row] scores
      logprob = float(picked[row][span].sum() + final[row][last_token])
      is_greedy = bool(greedy[row][span].all() and int(np.argmax(final[row])) == last_token)
      out.append((logprob, is_greedy))
    for (request, _, _), answer in zip(requests, out):
      if request is not None:
        self.cache_hook.add_partial("loglikelihood", request, answer)
    return out

  def _score_all(self, inputs: list[list[int]], targets: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Score rows in batches of self._rows, longest first, each batch right-padded to its power-of-two bucket."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    picked: list[Any] = [None] * len(inputs)
    greedy: list[Any] = [None] * len(inputs)
    final: list[Any] = [None] * len(inputs)
    for start in range(0, len(order), self._rows):
      chunk = order[start : start + self._rows]
      width = min(self._max_length, max(MIN_BUCKET, 1 << (len(inputs[chunk[0]]) - 1).bit_length()))
      tokens = np.zeros((self._rows, width), np.int32)
      goals = np.zeros((self._rows, width), np.int32)
      last = np.zeros((self._rows,), np.int32)
      for r, i in enumerate(chunk):
        n = len(inputs[i])
        tokens[r, :n], goals[r, :n], last[r] = inputs[i], targets[i], n - 1
      with self._mesh_context():
        p, g, f = jax.device_get(self._score(self._state, tokens, goals, last))
      for r, i in enumerate(chunk):
        n = len(inputs[i])
        picked[i], greedy[i], final[i] = p[r, :n], g[r, :n], f[r]
    return picked, greedy, final

  def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
    """log p(text) over the harness's disjoint windows of max_length tokens, the first conditioned on prefix_token_id."""
    windows, owners = [], []
    for i, (text,) in enumerate(r.args for r in requests):
      tokens = self.tok_encode(text)
      for context, continuation in map(make_disjoint_window, get_rolling_token_windows(tokens, self.prefix_token_id, self._max_length, 1)):
        windows.append((None, context, continuation))
        owners.append(i)
    totals = [0.0] * len(requests)
    for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
      totals[owner] += logprob
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return totals

  # -- generation ------------------------------------------------------------------------------------------
  def _sampling(self, kwargs: dict[str, Any]) -> SamplingParams:
    """gen_kwargs (after normalize_gen_kwargs) -> SamplingParams; greedy unless do_sample with a temperature > 0."""
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    top_k = kwargs.pop("top_k", None)
    top_p = kwargs.pop("top_p", None)
    if kwargs:
      raise DataError(f"gen_kwargs {sorted(kwargs)} are not supported by the maxtext backend; use until, max_gen_toks, do_sample, temperature, top_k, top_p")
    if not do_sample or temperature == 0.0:
      return SamplingParams()
    if top_p is not None and float(top_p) < 1.0:
      return SamplingParams("nucleus", temperature=temperature, nucleus_p=float(top_p))
    if top_k:
      return SamplingParams("topk", temperature=temperature, top_k=int(top_k))
    return SamplingParams("weighted", temperature=temperature)

  def _generator(self, prompt_bucket: int, max_gen_toks: int, sampling: SamplingParams) -> Generator:
    key = (prompt_bucket, max_gen_toks, sampling)
    if key not in self._generators:
      self._generators[key] = Generator(
        self.model,
        sampling,
        config=self.maxtext_config,
        max_target_length=prompt_bucket + max_gen_toks,
        max_prefill_length=prompt_bucket,
        eos_id=self.tokenizer.eos_id,
        mesh=self.mesh,
      )
    return self._generators[key]

  def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
    """Continuations of each context, cut at the first stop sequence (EOS's text included) or after max_gen_toks tokens."""
    out: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
      groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
    eos_text = self.tokenizer.decode([self.eot_token_id])
    for members in groups.values():
      kwargs = normalize_gen_kwargs(requests[members[0]].args[1], DEFAULT_MAX_GEN_TOKS)
      until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
      max_gen_toks = int(kwargs.pop("max_gen_toks"))
      sampling = self._sampling(kwargs)
      room = self._max_length - max_gen_toks
      if room < 1:
        raise DataError(
          f"a task asks for max_gen_toks={max_gen_toks}, which leaves no room for a prompt within max_length {self._max_length}; raise max_length"
        )
      prompts = {i: self.tok_encode(requests[i].args[0])[-room:] for i in members}
      order = sorted(members, key=lambda i: -len(prompts[i]))
      for start in range(0, len(order), self._batch):
        chunk = order[start : start + self._batch]
        batch = [prompts[i] for i in chunk]
        batch += [batch[0]] * (self._batch - len(batch))  # one compile per batch size
        gen = self._generator(prefill_bucket(len(batch[0]), room), max_gen_toks, sampling)
        result = gen.generate(batch, seed=self.maxtext_config.decode_sampling_seed, state=self._state)
        for i, tokens in zip(chunk, result.tokens):
          tokens = tokens[:max_gen_toks]
          if self.tokenizer.eos_id in tokens:
            tokens = tokens[: tokens.index(self.tokenizer.eos_id)]
          text = postprocess_generated_text(self.tok_decode(tokens), until, None)
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out  # type: ignore[return-value]


def results_lines(results: dict[str, Any]) -> list[str]:
  """One line per task of simple_evaluate's results: 'task: metric value, ... (N samples)' (stderr values left out)."""
  lines = []
  for task, metrics in results.get("results", {}).items():
    shown = [f"{k.split(',')[0]}: {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float)) and "_stderr" not in k and k != "sample_len"]
    samples = f" ({metrics['sample_len']} samples)" if "sample_len" in metrics else ""
    lines.append(f"{task}: {', '.join(shown)}{samples}")
  return lines
