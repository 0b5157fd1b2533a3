"""Generation: a jitted prefill, a jitted decode step and a jitted on-device loop, compiled once per length bucket.

Prompts are right-padded to a power-of-two bucket (at least 16, at most max_prefill_predict_length) so
prompts of other lengths reuse the compiled prefill. Each row keeps its own position: row b's prompt
fills positions 0 .. len_b - 1 and its generated tokens follow. The loop runs on device
(jax.lax.while_loop) until every row has emitted EOS or reached max_target_length tokens in all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from maxtext import mesh as mesh_lib
from maxtext.config import MaxTextConfig
from maxtext.config.adapters import adapter_names
from maxtext.errors import ConfigError, DataError
from maxtext.inference import cache_layout, forward, unstack
from maxtext.inference.cache_layout import DecodeCache
from maxtext.inference.sampling import SamplingParams, sample
from maxtext.models.decoder import Transformer

MIN_BUCKET = 16


def prefill_bucket(length: int, limit: int) -> int:
  """The padded prompt length: the next power of two >= length (at least MIN_BUCKET), capped at limit."""
  return min(limit, max(MIN_BUCKET, 1 << max(0, length - 1).bit_length()))


@dataclasses.dataclass
class Result:
  tokens: list[list[int]]  # generated tokens per prompt (EOS included when emitted)
  prefill_tokens: int  # prompt tokens (padding excluded)
  prefill_seconds: float
  decode_tokens: int  # generated tokens (the first comes from the prefill logits)
  decode_seconds: float  # the decode loop, sampling the first token included


def onto_mesh(state: nnx.State, config: MaxTextConfig, mesh: Mesh) -> nnx.State:
  """state with every array committed to devices other than mesh's moved onto mesh, sharded as the variable's logical
  axes map there (e.g. parameters loaded on the default GPU handed to a Generator on a CPU mesh); arrays already on
  the mesh's devices and host values are kept as they are (nothing copied)."""
  want = set(mesh.devices.flat)

  def place(path: tuple, v: nnx.Variable) -> nnx.Variable:
    value = v.get_value()
    if not isinstance(value, jax.Array) or value.sharding.device_set == want:
      return v
    name = "parameter " + "/".join(str(getattr(k, "key", k)) for k in path)
    return v.replace(jax.device_put(value, mesh_lib.checked_logical_sharding(v.get_metadata().get("logical_axes"), value.shape, config, mesh, name)))

  return jax.tree.map_with_path(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


class Generator:
  """Prefill and decode for one model. `generate(prompts)` takes token lists and returns generated token lists."""

  def __init__(
    self,
    model: Transformer,
    sampling: SamplingParams | None = None,
    *,
    config: MaxTextConfig,
    max_target_length: int | None = None,
    max_prefill_length: int | None = None,
    eos_id: int | None = None,
    mesh: Mesh | None = None,
    fixed_bucket: bool = False,
    tokenizer_vocab_size: int | None = None,
  ):
    """config: the model's (the model keeps only its spec): the cache layout, the lengths' defaults, LoRA slots.
    fixed_bucket: pad every prompt batch to max_prefill_length (one prefill compile for all prompt lengths).
    tokenizer_vocab_size: the ids the tokenizer can decode; with a padded vocabulary (the model's vocab_size larger)
    the ids from it up are never sampled. None: every id of the model's vocabulary may be."""
    # the model's layer arrangement decides the cache's (unstack.for_decoding may have unstacked a scanned model)
    c = config if config.scan_layers == model.spec.scan_layers else config.model_copy(update={"scan_layers": model.spec.scan_layers})
    self.config = c
    self.sampling = sampling or SamplingParams()
    self.max_target_length = max_target_length or c.max_target_length
    self.max_prefill_length = max_prefill_length or c.max_prefill_predict_length
    self.check_lengths(self.max_target_length, self.max_prefill_length)
    self.eos_id = -1 if eos_id is None else int(eos_id)
    self.mesh = mesh
    self.fixed_bucket = fixed_bucket
    self.tokenizer_vocab_size = check_tokenizer_vocab_size(tokenizer_vocab_size, c.vocab_size)
    self.layout = cache_layout.layout(c, self.max_target_length)
    self.graphdef, self.state = nnx.split(model)
    if mesh is not None:
      self.state = onto_mesh(self.state, c, mesh)
    self.prefill = jax.jit(self._prefill)
    self.step = jax.jit(self._step, donate_argnums=1)
    self.loop = jax.jit(self._loop)
    self._executables: dict[tuple[int, int, bool], tuple] = {}

  @staticmethod
  def check_lengths(max_target_length: int, max_prefill_length: int) -> None:
    if max_prefill_length >= max_target_length:
      raise ConfigError(
        f"max_prefill_predict_length {max_prefill_length} leaves no room to generate within max_target_length {max_target_length}; "
        "raise max_target_length or lower max_prefill_predict_length"
      )

  @staticmethod
  def check_prompt(prompt: Sequence[int], max_prefill_length: int, vocab_size: int) -> None:
    """A prompt must have 1 to max_prefill_length tokens, each inside the vocabulary: else a one-line DataError."""
    if len(prompt) == 0:
      raise DataError("the prompt is empty; pass at least one token")
    if len(prompt) > max_prefill_length:
      raise DataError(
        f"the prompt has {len(prompt)} tokens, more than max_prefill_predict_length={max_prefill_length}; shorten it or raise max_prefill_predict_length"
      )
    if any(t < 0 or t >= vocab_size for t in prompt):
      raise DataError(f"a prompt token id is outside the model's vocabulary of {vocab_size}; use the tokenizer the model was trained with")

  def adapter_slots(self, adapter_ids: Sequence[int | str] | None, prompts: int, rows: int) -> np.ndarray | None:
    """Per-prompt adapters (names from lora.lora_adapters, slot numbers, or -1 for the base model) -> slots [rows]
    (padding rows on the base model); None when not given. Needs a model with lora.max_lora_adapters > 1."""
    if adapter_ids is None:
      return None
    c = self.config
    if not (c.lora.enable_lora and c.lora.max_lora_adapters > 1):
      raise ConfigError("adapter_ids pick one of several LoRA adapters per prompt; this model has none (set lora.enable_lora and lora.max_lora_adapters > 1)")
    names = adapter_names(c)
    ids = list(adapter_ids)
    if len(ids) != prompts:
      raise DataError(f"{len(ids)} adapter_ids for {prompts} prompts; give one adapter (name, slot or -1) per prompt")
    slots = np.full((rows,), -1, np.int32)
    for i, a in enumerate(ids):
      if isinstance(a, str) and a in names:
        slots[i] = names.index(a)
      elif isinstance(a, (int, np.integer)) and not isinstance(a, bool) and -1 <= a < len(names):
        slots[i] = int(a)
      else:
        raise DataError(f"adapter {a!r} of prompt {i} is not one of this model's adapters {names}; use a name, a slot 0..{len(names) - 1} or -1 (base)")
    return slots

  # -- pure functions of (state, ...) -------------------------------------------------------------------------
  def _model(self, state: nnx.State) -> Transformer:
    return nnx.merge(self.graphdef, state)

  def _prefill(
    self, state: nnx.State, tokens: jax.Array, lengths: jax.Array, adapter_ids: jax.Array | None = None, images: jax.Array | None = None
  ) -> tuple[DecodeCache, jax.Array]:
    """Right-padded prompts [B, P] with lengths [B] (and their images [B, M, S, S, 3]) -> (cache holding them, logits
    [B, V] at each row's last prompt token)."""
    model = self._model(state)
    cache = cache_layout.zeros(self.config, tokens.shape[0], self.layout)
    hidden, cache = forward.hidden_states(model, tokens, lengths, cache, self.layout, adapter_ids, images)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return cache, model.logits(last)

  def _step(
    self, state: nnx.State, cache: DecodeCache, tokens: jax.Array, adapter_ids: jax.Array | None = None, rope_deltas: jax.Array | None = None
  ) -> tuple[DecodeCache, jax.Array]:
    """One token per row [B] at each row's next position -> (cache, logits [B, V]). rope_deltas [B]: Qwen3-VL's, after
    a prefill with images (forward.hidden_states)."""
    model = self._model(state)
    hidden, cache = forward.hidden_states(model, tokens[:, None], jnp.ones_like(tokens), cache, self.layout, adapter_ids, rope_deltas=rope_deltas)
    return cache, model.logits(hidden[:, 0])

  def _loop(
    self,
    state: nnx.State,
    cache: DecodeCache,
    logits: jax.Array,
    prompt_lengths: jax.Array,
    key: jax.Array,
    eos_id: jax.Array,
    adapter_ids: jax.Array | None = None,
    rope_deltas: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample from the prefill logits, then decode until every row is done -> (tokens [B, max_target_length], counts [B], steps)."""
    b = logits.shape[0]
    budget = self.max_target_length - prompt_lengths  # tokens each row may generate
    out = jnp.zeros((b, self.max_target_length), jnp.int32)
    rows = jnp.arange(b)

    def emit(carry_out, counts, done, logits, i):
      tok = sample(logits, jax.random.fold_in(key, i), self.sampling, self.tokenizer_vocab_size)
      write = ~done
      carry_out = carry_out.at[rows, jnp.where(write, counts, self.max_target_length)].set(tok, mode="drop")  # finished rows write nowhere
      counts = counts + write
      done = done | (tok == eos_id) | (counts >= budget)
      return carry_out, counts, done, tok

    counts = jnp.zeros((b,), jnp.int32)
    out, counts, done, tok = emit(out, counts, jnp.zeros((b,), bool), logits, 0)

    def cond(carry):
      return ~jnp.all(carry[3])

    def body(carry):
      cache, out, counts, done, tok, i = carry
      cache, logits = self._step(state, cache, tok, adapter_ids, rope_deltas)
      out, counts, done, tok = emit(out, counts, done, logits, i)
      return cache, out, counts, done, tok, i + 1

    _, out, counts, _, _, steps = jax.lax.while_loop(cond, body, (cache, out, counts, done, tok, jnp.ones((), jnp.int32)))
    return out, counts, steps

  # -- host side ---------------------------------------------------------------------------------------------
  def batch_multiple(self) -> int:
    """Rows must come in multiples of the devices the batch is split over (cache_batch's mesh axes)."""
    if self.mesh is None:
      return 1
    spec = mesh_lib.logical_to_spec(("cache_batch",), self.config.logical_axis_rules, self.mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return int(np.prod([self.mesh.shape[a] for a in axes]))

  def pad(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (right-padded tokens [B', bucket], lengths [B']); B' rounds B up to batch_multiple (dummy rows)."""
    if not prompts:
      raise DataError("no prompts given; pass at least one")
    for p in prompts:
      self.check_prompt(p, self.max_prefill_length, self.config.vocab_size)
    rows = -(-len(prompts) // self.batch_multiple()) * self.batch_multiple()
    width = self.max_prefill_length if self.fixed_bucket else prefill_bucket(max(len(p) for p in prompts), self.max_prefill_length)
    tokens = np.zeros((rows, width), np.int32)
    lengths = np.ones((rows,), np.int32)
    for i, p in enumerate(prompts):
      tokens[i, : len(p)] = p
      lengths[i] = len(p)
    return tokens, lengths

  def compile(self, batch: int, prompt_length: int, adapters: bool = False, images: int = 0, sample_images: Sequence[np.ndarray] = ()) -> float:
    """Compile prefill and the decode loop for this batch and the bucket of prompt_length (adapters: for calls that
    pass adapter_ids; images: for prompts with up to this many images each; Qwen3-VL, whose input shapes follow the
    images' sizes: sample_images, each prompt's images) ahead of time; returns seconds."""
    start = time.perf_counter()
    tokens, lengths = self.pad([[0] * prompt_length] * batch)
    size = self.config.tile_size_for_vit if self.config.decoder_block == "llama4" else self.config.image_size_for_vit  # llama4: images counts tiles
    pixels = np.zeros((tokens.shape[0], images, size, size, 3), np.float32) if images else None
    deltas = None
    if images and self.config.vision_encoder_block == "qwen3_vl":
      from maxtext.models import vision_specs
      from maxtext.vision import qwen3_vl_encoder

      pixels = qwen3_vl_encoder.empty_batch(tokens.shape[0], tokens.shape[1], sample_images, vision_specs.vision(self.config))
      deltas = np.zeros(tokens.shape[:1], np.int32)
    self._executables_for(tokens, lengths, np.zeros(tokens.shape[:1], np.int32) if adapters else None, pixels, deltas)
    return time.perf_counter() - start

  def _executables_for(
    self, tokens: np.ndarray, lengths: np.ndarray, adapter_ids: np.ndarray | None = None, images=None, rope_deltas: np.ndarray | None = None
  ) -> tuple:
    shapes_of_images = tuple(np.shape(a) for a in jax.tree.leaves(images))  # pixels, or Qwen3-VL's patches, layout and rope positions
    rope = ("rope_deltas",) if rope_deltas is not None else ()  # Qwen3-VL's decode steps take them
    key = (*tokens.shape, adapter_ids is not None) + rope + shapes_of_images  # (batch, bucket, with adapter ids[, images])
    if key not in self._executables:
      with self._mesh_context():
        prefill = self.prefill.lower(self.state, tokens, lengths, adapter_ids, images).compile()
        shapes = jax.eval_shape(self._prefill, self.state, tokens, lengths, adapter_ids, images)
        cache, logits = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, prefill.output_shardings)
        loop = self.loop.lower(self.state, cache, logits, lengths, jax.random.key(0), jnp.int32(0), adapter_ids, rope_deltas).compile()
      self._executables[key] = (prefill, loop)
    return self._executables[key]

  def _mesh_context(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    seed: int = 0,
    adapter_ids: Sequence[int | str] | None = None,
    *,
    state: nnx.State | None = None,
    key: jax.Array | None = None,
    images: Sequence[Sequence[np.ndarray]] | None = None,
  ) -> Result:
    """Generated tokens for each prompt (compiled once per batch size and prompt bucket), with timings.

    adapter_ids: each prompt's LoRA adapter (name, slot or -1 for the base) when the model holds several; one batch
    may mix them. state: parameters to decode with instead of the model's own (same structure, shardings and
    layouts, e.g. a train state's live parameters: nothing is copied). key: the sampling key instead of key(seed).
    images: per prompt, its RGB uint8 images [h, w, 3] in the order of its runs of image placeholders
    (use_multimodal); each run holds mm_tokens_per_image placeholder ids.
    """
    state = self.state if state is None else state
    key = jax.random.key(seed) if key is None else key
    tokens, lengths = self.pad(prompts)
    slots = self.adapter_slots(adapter_ids, len(prompts), tokens.shape[0])
    deltas = None
    if images is not None and self.config.use_multimodal and self.config.vision_encoder_block == "qwen3_vl":
      pixels, deltas = qwen3_vl_prompt_images(self.config, prompts, images, tokens)
    else:
      pixels = None if images is None else prompt_images(self.config, prompts, images, tokens.shape[0])
    prefill, loop = self._executables_for(tokens, lengths, slots, pixels, deltas)
    with self._mesh_context():
      start = time.perf_counter()
      cache, logits = prefill(state, tokens, lengths, slots, pixels)
      logits.block_until_ready()
      prefill_seconds = time.perf_counter() - start
      start = time.perf_counter()
      out, counts, _ = jax.device_get(loop(state, cache, logits, lengths, key, jnp.int32(self.eos_id), slots, deltas))
      decode_seconds = time.perf_counter() - start
    generated = [out[i, : counts[i]].tolist() for i in range(len(prompts))]
    return Result(generated, int(lengths[: len(prompts)].sum()), prefill_seconds, int(counts[: len(prompts)].sum()), decode_seconds)


def generate(
  model: Transformer,
  tokenizer,
  prompts: str | Sequence[str],
  *,
  config: MaxTextConfig,
  sampling: SamplingParams | None = None,
  max_target_length: int | None = None,
  max_prefill_predict_length: int | None = None,
  seed: int = 0,
  add_bos: bool | None = None,
  adapter_ids: str | int | Sequence[str | int] | None = None,
) -> str | list[str]:
  """Complete text prompts with a model and its tokenizer; returns the completions (without the prompt).

  adapter_ids: with several LoRA adapters (lora.max_lora_adapters > 1), each prompt's adapter: a name from
  lora.lora_adapters, a slot number or -1 (the base model); one value applies to every prompt.

  config: the model's. Defaults come from it: the decode_sampling_* keys, max_target_length, max_prefill_predict_length
  and add_bos. A tokenizer whose vocabulary does not fit the model's is a DataError; with a padded vocabulary
  (the model's larger than the tokenizer's) the ids the tokenizer cannot decode are never sampled.
  """
  c = config
  check_tokenizer(tokenizer, c.vocab_size)
  single = isinstance(prompts, str)
  texts = [prompts] if single else list(prompts)
  add_bos = c.add_bos if add_bos is None else add_bos
  bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
  gen = Generator(
    unstack.for_decoding(model),
    sampling or SamplingParams.from_config(c),
    config=c,
    max_target_length=max_target_length,
    max_prefill_length=max_prefill_predict_length,
    eos_id=tokenizer.eos_id,
    tokenizer_vocab_size=tokenizer.vocab_size,
  )
  if adapter_ids is not None and (isinstance(adapter_ids, (str, int, np.integer)) or np.ndim(adapter_ids) == 0):
    adapter_ids = [adapter_ids] * len(texts)
  result = gen.generate([bos + tokenizer.encode(t) for t in texts], seed=seed, adapter_ids=adapter_ids)
  completions = [tokenizer.decode([t for t in toks if t != tokenizer.eos_id]) for toks in result.tokens]
  return completions[0] if single else completions


def prompt_images(config: MaxTextConfig, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[np.ndarray]], rows: int) -> np.ndarray:
  """Each prompt's images -> preprocessed pixels [rows, M, S, S, 3] (M the most any prompt has; unused slots zero). Each
  prompt's runs of placeholders must be whole images, one per image given: else a one-line DataError."""
  from maxtext.data.images import check_placeholders, pixels_of

  if not config.use_multimodal:
    raise ConfigError(f"images were given to a text-only model (decoder_block={config.decoder_block}, use_multimodal=false); give prompts alone")
  if len(images) != len(prompts):
    raise DataError(f"{len(images)} image lists for {len(prompts)} prompts; give one list (possibly empty) per prompt")
  if config.decoder_block == "llama4":  # each image cut into tiles (maxtext.vision.llama4_preprocess)
    from maxtext.vision.llama4_preprocess import prompt_tiles

    return prompt_tiles(config, prompts, images, rows)
  size, most = config.image_size_for_vit, max(1, max(len(row) for row in images))
  out = np.zeros((rows, most, size, size, 3), np.float32)
  for i, (prompt, row) in enumerate(zip(prompts, images)):
    check_placeholders(prompt, len(row), config.image_token_id, config.mm_tokens_per_image, f"prompt {i}")
    if row:
      out[i, : len(row)] = pixels_of(list(row), size, f"prompt {i}")
  return out


def qwen3_vl_prompt_images(config: MaxTextConfig, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[np.ndarray]], tokens: np.ndarray) -> tuple:
  """Qwen3-VL: each prompt's images -> (Qwen3VLImages for the padded prompt rows, each row's rope delta [rows] int32).
  Each prompt's placeholders must hold its images' merged tokens, in order: else a one-line DataError."""
  from maxtext.models import vision_specs
  from maxtext.vision import qwen3_vl_encoder

  if len(images) != len(prompts):
    raise DataError(f"{len(images)} image lists for {len(prompts)} prompts; give one list (possibly empty) per prompt")
  rows = [list(row) for row in images] + [[]] * (tokens.shape[0] - len(prompts))
  try:
    batch, deltas = qwen3_vl_encoder.prepare(tokens.tolist(), rows, vision_specs.vision(config))
  except ValueError as e:
    raise DataError(
      f"the prompts' image placeholders do not fit their images: {e}; put each image's tokens (qwen3_vl_encoder.image_tokens) at its place"
    ) from None
  return batch, np.asarray(deltas, np.int32)


def check_tokenizer(tokenizer, vocab_size: int) -> None:
  """A tokenizer with more tokens than the model's vocabulary cannot have been trained with it: a DataError."""
  if tokenizer.vocab_size > vocab_size:
    raise DataError(
      f"tokenizer '{tokenizer.path}' has {tokenizer.vocab_size} tokens but the model's vocabulary has {vocab_size}; use the tokenizer the model was trained with"
    )


def check_tokenizer_vocab_size(tokenizer_vocab_size: int | None, vocab_size: int) -> int | None:
  """Generator's tokenizer_vocab_size: None, or 1 .. the model's vocab_size (a ConfigError otherwise)."""
  if tokenizer_vocab_size is None:
    return None
  if isinstance(tokenizer_vocab_size, bool) or not 1 <= int(tokenizer_vocab_size) <= vocab_size:
    raise ConfigError(
      f"tokenizer_vocab_size={tokenizer_vocab_size!r} is not between 1 and the model's vocab_size {vocab_size}; pass the tokenizer's vocab_size (or None)"
    )
  return int(tokenizer_vocab_size)
