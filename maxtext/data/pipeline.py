"""The grain pipeline of one process: records -> documents -> rows (truncated or chunked) -> packed/padded -> batches."""

from __future__ import annotations

from typing import Any

import grain
import grain.experimental as gx
import numpy as np

from maxtext.config import MaxTextConfig, adapters
from maxtext.data import embedded, features, mixture, preference, prompts, sources
from maxtext.data.sft import resolve_chat_template
from maxtext.errors import ConfigError
from maxtext.tokenizer import Tokenizer, load_tokenizer

MIN_PACKING_BINS = 16
SURVEY_PAIRS = 2000  # DPO: the pairs read at setup to count the dropped ones (all of a smaller data set)


def resolve_tokenizer(config: MaxTextConfig) -> Tokenizer:
  """The configured tokenizer; for dataset_type=embedded with no tokenizer_path, the cached corpus tokenizer."""
  path = config.tokenizer_path
  if not path and config.dataset_type == "embedded":
    if config.tokenizer_type != "sentencepiece":
      raise ConfigError("dataset_type=embedded without tokenizer_path trains a sentencepiece tokenizer; set tokenizer_type=sentencepiece or tokenizer_path")
    # with images, the ids from image_token_id up stay free for the image placeholders (embedded image-text set)
    path = embedded.cached_tokenizer(config.base_output_directory, embedded.tokenizer_size(config))
  tokenizer = load_tokenizer(config.tokenizer_type, path)
  if tokenizer.vocab_size > config.vocab_size:
    raise ConfigError(f"tokenizer '{path}' has {tokenizer.vocab_size} tokens but vocab_size is {config.vocab_size}; set vocab_size >= {tokenizer.vocab_size}")
  return tokenizer


def make_encoder(config: MaxTextConfig, tokenizer: Tokenizer, split: str = "train") -> features.DocumentEncoder:
  """The record encoder of the run's objective: documents, SFT conversations, DPO pairs or GRPO prompts."""
  template = resolve_chat_template(config.chat_template, config.chat_template_path, tokenizer.chat_template, tokenizer.path) if config.use_sft else None
  kwargs = dict(
    add_bos=config.add_bos,
    add_eos=config.add_eos,
    use_sft=config.use_sft,
    completion_only=config.sft_train_on_completion_only,
    chat_template=template,
    adapter_column=config.lora.adapter_column,
    adapter_names=adapter_names(config),
  )
  if config.use_multimodal and (config.use_dpo or config.use_grpo):
    raise ConfigError("use_multimodal trains on image-text documents and SFT turns; DPO and GRPO with images are not supported: set use_multimodal=false")
  if config.use_dpo:
    return preference.PairEncoder(tokenizer, config.train_data_columns, max_length=config.max_target_length, **kwargs)
  if config.use_grpo:
    return prompts.PromptEncoder(tokenizer, config.train_data_columns, max_length=config.max_prefill_predict_length, **kwargs)
  if config.use_multimodal and config.vision_encoder_block == "qwen3_vl":
    return qwen3_vl_encoder(config, tokenizer, split, kwargs)
  if config.use_multimodal:
    return image_text_encoder(config, tokenizer, split, kwargs)
  return features.DocumentEncoder(tokenizer, config.train_data_columns, **kwargs)


def image_text_encoder(config: MaxTextConfig, tokenizer: Tokenizer, split: str, kwargs: dict[str, Any]) -> features.DocumentEncoder:
  """use_multimodal: documents with images at their image_placeholder places (maxtext.data.image_text)."""
  from maxtext.data.image_text import ImageTextEncoder, Llama4ImageTextEncoder
  from maxtext.models import vision_specs

  if not 0 <= config.image_token_id < config.vocab_size:
    raise ConfigError(
      f"image_token_id={config.image_token_id} is outside the vocabulary of {config.vocab_size}; set image_token_id to the tokenizer's image token"
    )
  common = dict(
    image_column=config.train_image_column if split == "train" else config.eval_image_column,
    placeholder=config.image_placeholder,
    image_token_id=config.image_token_id,
    max_length=config.max_target_length,
    max_images=config.max_num_images_per_example,
  )
  if config.decoder_block == "llama4":  # each image cut into tiles, tokens_per_image placeholders a tile
    spec = vision_specs.vision(config)
    return Llama4ImageTextEncoder(
      tokenizer,
      config.train_data_columns,
      tokens_per_image=spec.tokens_per_image,
      image_size=spec.tile_size,
      max_tiles=config.max_num_tiles_for_vit,
      **common,
      **kwargs,
    )
  return ImageTextEncoder(
    tokenizer, config.train_data_columns, tokens_per_image=config.mm_tokens_per_image, image_size=config.image_size_for_vit, **common, **kwargs
  )


def qwen3_vl_encoder(config: MaxTextConfig, tokenizer: Tokenizer, split: str, kwargs: dict[str, Any]) -> features.DocumentEncoder:
  """use_multimodal with vision_encoder_block=qwen3_vl: documents with their images' patches (maxtext.data.qwen3_vl_records)."""
  from maxtext.data.qwen3_vl_records import Qwen3VLImageTextEncoder, patch_budget
  from maxtext.models import vision_specs

  spec = vision_specs.vision(config)
  return Qwen3VLImageTextEncoder(
    tokenizer,
    config.train_data_columns,
    image_column=config.train_image_column if split == "train" else config.eval_image_column,
    placeholder=config.image_placeholder,
    spec=spec,
    max_length=config.max_target_length,
    max_images=config.max_num_images_per_example,
    budget=patch_budget(config, spec),
    **kwargs,
  )


def adapter_names(config: MaxTextConfig) -> list[str]:
  """The adapter slots' names, in slot order, when lora.adapter_column routes documents to them."""
  if not config.lora.adapter_column:
    return []
  return adapters.adapter_names(config)


def open_source(config: MaxTextConfig, split: str, process_index: int, process_count: int, num_epoch: int) -> sources.Source:
  kind = config.dataset_type
  if kind == "grain":
    source = sources.grain_source(config, split)
    if not source.random_access:
      source.dataset = sources.streamed_share(source.dataset, process_index, process_count)
    return source
  if kind == "tfds":
    return sources.tfds_source(config, split)
  if kind == "hf":
    return sources.hf_source(config, split, process_index, process_count, num_epoch)
  if kind == "embedded" and config.use_multimodal:
    from maxtext.data import shapes

    return shapes.source(split, config.image_placeholder)
  if kind == "embedded":
    return embedded.source(split)
  raise ConfigError(f"dataset_type '{kind}' has no file pipeline; use grain, tfds, hf, embedded or synthetic")


def encoded_documents(config: MaxTextConfig, split: str, process_index: int, process_count: int) -> tuple[grain.IterDataset, sources.Source]:
  """This process's share of the split's records, shuffled and repeated num_epoch times, through the run's encoder
  (records with nothing to learn dropped), and the source they come from."""
  training = split == "train"
  shuffle = training and config.enable_data_shuffling
  num_epoch = config.num_epoch if training else 1
  if shuffle and not 0 <= config.data_shuffle_seed < 2**32:
    raise ConfigError(f"invalid value for 'data_shuffle_seed': {config.data_shuffle_seed}; use an integer in [0, 2**32)")
  found = mixture.components(config, split)
  encoder = make_encoder(config, resolve_tokenizer(config), split)
  if found:  # a weighted mixture: shuffled, shared and repeated per component
    source = mixture.mixed_documents(config, found, encoder, process_index, process_count)
    return source.dataset, source
  source = open_source(config, split, process_index, process_count, num_epoch)

  if source.random_access:
    ds: Any = source.dataset
    if shuffle:
      ds = ds.shuffle(seed=config.data_shuffle_seed)
    if num_epoch > 1:
      ds = ds.repeat(num_epoch)
    share = sources.process_share(len(ds), process_index, process_count)
    ds = ds[share.start : share.stop : share.step]
    ds = ds.map(encoder).filter(is_document).to_iter_dataset()
  else:
    ds = source.dataset
    if num_epoch > 1 and config.dataset_type != "hf":  # HFStream repeats itself
      ds = gx.RepeatIterDataset(ds, num_epochs=num_epoch)
    if shuffle:
      ds = gx.WindowShuffleIterDataset(ds, window_size=config.grain_shuffle_buffer_size, seed=config.data_shuffle_seed)
    ds = ds.map(encoder).filter(is_document)
  return ds, source


def survey_pairs(config: MaxTextConfig, split: str, process_index: int, process_count: int) -> preference.Survey:
  """DPO: this process's first SURVEY_PAIRS pairs of split (in file order) encoded, and the dropped ones counted by reason."""
  encoder = make_encoder(config, resolve_tokenizer(config))
  source = open_source(config, split, process_index, process_count, num_epoch=1)
  if source.random_access:
    share = sources.process_share(len(source.dataset), process_index, process_count)
    records: Any = (source.dataset[i] for i in range(share.start, share.stop, share.step))
  else:
    records = iter(source.dataset)
  survey = preference.survey(encoder, records, SURVEY_PAIRS)
  survey.description = source.description
  return survey


def local_batches(config: MaxTextConfig, split: str, process_index: int, process_count: int, local_batch: int) -> tuple[grain.IterDataset, str]:
  """This process's batches (dicts of int32 [local_batch, max_target_length]) and a description of the data."""
  if config.max_segments_per_seq == 0 or config.max_segments_per_seq < -1:
    raise ConfigError(f"invalid value for 'max_segments_per_seq': {config.max_segments_per_seq}; use -1 (no limit) or a positive integer")
  ds, source = encoded_documents(config, split, process_index, process_count)
  length = config.max_target_length
  segments = None if config.max_segments_per_seq == -1 else config.max_segments_per_seq
  row_images = None
  if config.use_dpo:  # elements are whole pairs, already shifted and truncated to fit a row
    packed = features.packed_features(bool(config.lora.adapter_column)) + preference.META_FEATURES
    meta, finalize, pad = preference.META_FEATURES, preference.finalize_packed_pairs, PadPair(length)
    segments = None if segments is None else max(1, segments // 2)  # a pair is two segments
  else:
    ds = ds.map(Truncate(length)) if config.use_truncation else gx.FlatMapIterDataset(ds, features.ChunkTransform(length))
    row_images = qwen3_vl_rows(config)
    packed = features.packed_features(bool(config.lora.adapter_column), config.use_multimodal and row_images is None)
    if isinstance(source.dataset, mixture.MixtureDataset):
      packed += (features.MIXTURE_KEY,)
    meta, finalize, pad = (), features.finalize_packed, Pad(length)
  lengths = {name: length for name in packed}
  if row_images is not None:  # a row's image patches fill a budget of their own
    lengths.update({name: row_images.budget for name in features.PATCH_FEATURES})
  if config.packing:
    ds = gx.FirstFitPackIterDataset(
      ds,
      length_struct=lengths,
      num_packing_bins=max(local_batch, MIN_PACKING_BINS),
      shuffle_bins=False,
      meta_features=meta,
      max_sequences_per_bin=segments,
    ).map(finalize)
  else:
    ds = ds.map(pad)
  if row_images is not None:
    ds = ds.map(row_images)
  return prefetched(config, ds.batch(local_batch, drop_remainder=split == "train"), source), source.description


def qwen3_vl_rows(config: MaxTextConfig) -> Any:
  """Qwen3-VL image-text training: the map giving each row its images' tower inputs (qwen3_vl_records.RowImages); else None."""
  if not (config.use_multimodal and config.vision_encoder_block == "qwen3_vl"):
    return None
  from maxtext.data.qwen3_vl_records import RowImages, patch_budget
  from maxtext.models import vision_specs

  spec = vision_specs.vision(config)
  return RowImages(spec, patch_budget(config, spec))


def prefetched(config: MaxTextConfig, ds: grain.IterDataset, source: sources.Source) -> grain.IterDataset:
  """ds read ahead: by worker processes for random-access sources (grain_worker_count > 0), else by a thread."""
  if source.random_access and config.grain_worker_count > 0:
    _ensure_absl_flags_parsed()  # grain's worker processes read absl flags
    options = grain.MultiprocessingOptions(num_workers=config.grain_worker_count, per_worker_buffer_size=max(1, config.grain_prefetch_buffer_size))
    ds = ds.mp_prefetch(options)
  elif config.grain_prefetch_buffer_size > 0:
    ds = gx.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=config.grain_prefetch_buffer_size)
  return ds


def _ensure_absl_flags_parsed() -> None:
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def is_document(doc: dict[str, np.ndarray] | None) -> bool:
  return doc is not None


class Truncate:
  def __init__(self, length: int):
    self.length = length

  def __call__(self, doc: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return features.truncate(doc, self.length)


class Pad:
  def __init__(self, length: int):
    self.length = length

  def __call__(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return features.pad_row(row, self.length)


class PadPair(Pad):
  def __call__(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return preference.pad_pair(element, self.length)
