"""The decode command: load, check, compile, generate, print the completion and the throughput."""

from __future__ import annotations

from collections.abc import Sequence

from maxtext import memory_limit
from maxtext import mesh as mesh_lib
from maxtext.config import MaxTextConfig
from maxtext.config.adapters import adapter_names
from maxtext.errors import ConfigError
from maxtext.inference import cache_layout, unstack
from maxtext.inference.generate import Generator
from maxtext.inference.loading import check_save_path, hf_config, load_decode_tokenizer, load_model
from maxtext.inference.sampling import SamplingParams


def log(message: str) -> None:
  print(message, flush=True)


def check_adapter(config: MaxTextConfig) -> list[str] | None:
  """decode_lora_adapter as the prompt's adapter_ids (None when unset); an adapter the config lacks is a ConfigError."""
  name = config.decode_lora_adapter
  if not name:
    return None
  if not (config.lora.enable_lora and config.lora.max_lora_adapters > 1):
    raise ConfigError(f"decode_lora_adapter='{name}' picks one of several LoRA adapters; set lora.enable_lora=true and lora.max_lora_adapters > 1, or drop it")
  names = adapter_names(config)
  if name not in names:
    raise ConfigError(f"decode_lora_adapter='{name}' is not one of the adapters {names} (lora.lora_adapters); pick one of them")
  return [name]


def prompt_images(config: MaxTextConfig) -> list:
  """The images of image_path (comma-separated files) as RGB uint8 arrays; a text-only model given any, or an unreadable
  file, is a one-line error."""
  from maxtext.data.images import read_image

  paths = [p.strip() for p in config.image_path.split(",") if p.strip()]
  if paths and not config.use_multimodal:
    raise ConfigError(
      f"image_path gives images to a text-only model (decoder_block={config.decoder_block}, use_multimodal=false); drop image_path or use a multimodal model"
    )
  return [read_image(p, None, f"image_path '{p}'") for p in paths]


def encode_with_images(config: MaxTextConfig, tokenizer, text: str, images: int, per_image: Sequence[int] | None = None) -> list[int]:
  """The prompt's tokens with each image_placeholder replaced by mm_tokens_per_image image ids (per_image: each
  image's own count, Qwen3-VL's); as many places as images."""
  from maxtext.errors import DataError

  parts = text.split(config.image_placeholder)
  if len(parts) - 1 != images:
    raise DataError(f"the prompt has {len(parts) - 1} '{config.image_placeholder}' place(s) but image_path gives {images} image(s); give one image per place")
  ids = tokenizer.encode(parts[0]) if parts[0] else []
  for k, part in enumerate(parts[1:]):
    count = config.mm_tokens_per_image if per_image is None else per_image[k]
    ids += [config.image_token_id] * count + (tokenizer.encode(part) if part else [])
  return ids


def qwen3_vl_image_tokens(config: MaxTextConfig, images: list) -> list[int] | None:
  """Qwen3-VL (vision_encoder_block=qwen3_vl): each image's placeholder count, from its size; None for other models.
  The image ids go where the prompt's image_placeholder is (write <|vision_start|> and <|vision_end|> around it)."""
  if not (config.use_multimodal and config.vision_encoder_block == "qwen3_vl"):
    return None
  from maxtext.models import vision_specs
  from maxtext.vision.qwen3_vl_encoder import image_tokens

  spec = vision_specs.vision(config)
  return [image_tokens(image, spec) for image in images]


def check_training_only_axes(config: MaxTextConfig) -> None:
  """Decoding runs no pipeline and no context parallelism: a config that asks for either is a one-line error."""
  from maxtext.config.parallelism import axis_size

  for axis, keys in (("stage", "ici_pipeline_parallelism, dcn_pipeline_parallelism"), ("context", "ici_context_parallelism, dcn_context_parallelism")):
    if axis_size(config.ici_parallelism, config.dcn_parallelism, config.mesh_axes, axis) > 1:
      raise ConfigError(f"decode does not use the '{axis}' mesh axis (training only); set {keys} to 1 (checkpoints do not depend on them)")


def check_sparse_context(config: MaxTextConfig) -> None:
  """DeepSeek Sparse Attention selects indexer_topk keys of the cache; a top-k beyond the whole context (max_target_length)
  would select every key, which is dense attention under another name: a one-line error."""
  if config.use_indexer and config.indexer_topk > config.max_target_length:
    raise ConfigError(
      f"indexer_topk={config.indexer_topk} is larger than the decode context max_target_length={config.max_target_length}, so the indexer would "
      "select every key; raise max_target_length or lower indexer_topk"
    )


def run(config: MaxTextConfig, argv: Sequence[str]) -> None:
  check_training_only_axes(config)
  check_save_path(config)
  if config.hf_model_path:
    config = hf_config(argv, config.hf_model_path)
  check_sparse_context(config)
  sampling = SamplingParams.from_config(config)
  tokenizer = load_decode_tokenizer(config)
  text, eos_id = config.prompt, tokenizer.eos_id
  if config.use_chat_template:
    from maxtext.inference.chat_prompt import render_prompt

    text, end_id = render_prompt(config, tokenizer)
    eos_id = end_id if end_id is not None else eos_id  # a reply ends with the template's end-of-turn token
  bos = [tokenizer.bos_id] if config.add_bos and tokenizer.bos_id is not None else []
  images = prompt_images(config)  # read and checked before the model loads
  if config.use_multimodal and config.decoder_block == "llama4":  # each image's tiles and markers (maxtext.vision.llama4_preprocess)
    from maxtext.models import vision_specs
    from maxtext.vision.llama4_preprocess import encode_prompt

    prompt = encode_prompt(config, tokenizer, text, images)
    slots = prompt.count(config.image_token_id) // vision_specs.vision(config).tokens_per_image  # the tower's inputs are tiles
  else:
    per_image = qwen3_vl_image_tokens(config, images)
    prompt = encode_with_images(config, tokenizer, text, len(images), per_image) if config.use_multimodal else tokenizer.encode(text)
    slots = len(images)
  prompt = prompt if config.use_chat_template and bos and prompt[:1] == bos else bos + prompt  # a template may write BOS itself
  mesh = mesh_lib.create(config)
  generator_args = dict(
    max_target_length=config.max_target_length,
    max_prefill_length=config.max_prefill_predict_length,
    eos_id=eos_id,
    tokenizer_vocab_size=tokenizer.vocab_size,  # a padded vocabulary's extra ids are never sampled
  )
  Generator.check_lengths(config.max_target_length, config.max_prefill_predict_length)
  Generator.check_prompt(prompt, config.max_prefill_predict_length, config.vocab_size)
  adapter_ids = check_adapter(config)
  remedy = (
    f"lower max_target_length ({config.max_target_length}) or max_prefill_predict_length ({config.max_prefill_predict_length}), or shard over more devices"
  )
  with memory_limit.one_line("loading the model and compiling decode", remedy):
    model = unstack.for_decoding(load_model(config, mesh, log))
    generator = Generator(model, sampling, config=config, mesh=mesh, **generator_args)
    seconds = generator.compile(batch=1, prompt_length=len(prompt), adapters=adapter_ids is not None, images=slots, sample_images=images)
  log(f"compiled prefill and decode in {seconds:.1f}s")
  log(cache_layout.describe(config, 1, generator.layout))
  with memory_limit.one_line("while decoding", remedy):
    result = generator.generate([prompt], seed=config.decode_sampling_seed, adapter_ids=adapter_ids, images=[images] if images else None)
  completion = tokenizer.decode([t for t in result.tokens[0] if t != eos_id])
  log(f"prompt: {text if config.use_chat_template else config.prompt}")
  log(f"completion: {completion}")
  log(
    f"prefill: {result.prefill_tokens} tokens in {result.prefill_seconds:.3f}s ({result.prefill_tokens / result.prefill_seconds:.1f} tokens/s); "
    f"decode: {result.decode_tokens} tokens in {result.decode_seconds:.3f}s ({result.decode_tokens / max(result.decode_seconds, 1e-9):.1f} tokens/s)"
  )
