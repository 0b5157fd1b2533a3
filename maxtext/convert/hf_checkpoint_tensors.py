"""A checkpoint's tensors as the conversion reads them: a multimodal checkpoint's text decoder under causal-LM names, each
weight checked (floating, finite), and one line naming the tensors left over with their likely cause."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from maxtext.config import MaxTextConfig
from maxtext.convert.hf_layouts import (
  Array,
)
from maxtext.errors import ConfigError, shorten

# Tensors of quantized checkpoints (FP8 block scales of DeepSeek's, bitsandbytes and GPTQ scales) that only a
# dequantizer consumes.
QUANTIZATION_SCALES = ("_scale_inv", ".weight_scale", ".scales", ".absmax", ".qzeros")


def layer_index(name: str) -> int:
  """i of a tensor 'model.layers.<i>.*'; -1 for a tensor outside the layers."""
  parts = name.split(".")
  return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


# Multimodal Gemma 3 checkpoints keep the text decoder under one of these prefixes (hub layout, transformers 5 layout),
# beside the vision tower and projector that a text decoder leaves out.
TEXT_DECODER_PREFIXES = ("language_model.model.", "model.language_model.")
VISION_PREFIXES = (
  "vision_tower.",
  "multi_modal_projector.",
  "model.vision_tower.",
  "model.multi_modal_projector.",
  "vision_model.",
  "model.vision_model.",
  "model.visual.",
)
VISION_PREFIXES += ("model.audio_tower.", "model.embed_vision.", "model.embed_audio.")  # Gemma 4's audio tower and modality embedders


def text_decoder_tensors(tensors: dict[str, Array]) -> dict[str, Array]:
  """The tensors of a checkpoint's text decoder under the names of a causal LM (model.*, lm_head.weight): a multimodal
  Gemma 3 checkpoint's language model without its vision tower; other checkpoints unchanged."""
  if not any(k.startswith(TEXT_DECODER_PREFIXES) for k in tensors):
    return tensors
  out = {}
  for k, v in tensors.items():
    if k.startswith(VISION_PREFIXES):
      continue
    prefix = next((p for p in TEXT_DECODER_PREFIXES if k.startswith(p)), None)
    out["model." + k[len(prefix) :] if prefix else k.replace("language_model.lm_head.", "lm_head.")] = v
  return out


def check_weight(name: str, value: Array) -> None:
  """A float weight as the checkpoint stores it: a floating dtype (bfloat16 and float8 included) and only finite values
  (one float64 sum per tensor, which no finite float32 tensor overflows), else a one-line ConfigError naming it."""
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise ConfigError(
      f"tensor '{name}' has dtype {value.dtype}, not a floating type; maxtext reads it as a float weight: "
      "the checkpoint is damaged or quantized in a format maxtext does not read (re-export it in float32 or bfloat16)"
    )
  if not np.isfinite(value.sum(dtype=np.float64)) and not np.isfinite(value).all():
    bad = value.size - int(np.count_nonzero(np.isfinite(value)))
    raise ConfigError(f"tensor '{name}' holds {bad} NaN or infinite value(s) of {value.size}; the checkpoint is corrupt: re-download or re-export it")


MULTIMODAL_TEXT_PREFIX = (
  "language_model."  # transformers 5's save_pretrained of Gemma3ForConditionalGeneration: language_model.model.*, language_model.lm_head.*
)


def check_all_used(unused: list[str], c: MaxTextConfig, stored_mtp_layers: int) -> None:
  """A one-line ConfigError naming the checkpoint's tensors the conversion did not consume, with the likely cause."""
  if not unused:
    return
  last = max(layer_index(k) for k in unused)
  if last >= c.num_decoder_layers + stored_mtp_layers:
    mtp = f" plus num_nextn_predict_layers={stored_mtp_layers} MTP layer(s)" if stored_mtp_layers else ""
    raise ConfigError(
      f"the safetensors hold tensors of layer {last} ('{next(k for k in unused if layer_index(k) == last)}') but config.json's "
      f"num_hidden_layers is {c.num_decoder_layers}{mtp}: the layers past it would be dropped; fix num_hidden_layers (or remove the stray tensors)"
    )
  if any(k.endswith(QUANTIZATION_SCALES) for k in unused):
    raise ConfigError(
      f"the checkpoint is quantized ('{next(k for k in unused if k.endswith(QUANTIZATION_SCALES))}' is a scale tensor); "
      "maxtext reads float weights: dequantize it to bfloat16 first"
    )
  raise ConfigError(f"checkpoint has {len(unused)} tensor(s) the {c.decoder_block} model does not use: {shorten(unused)}; check the model type and config")


def first_line(e: Exception) -> str:
  return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
