"""Fold LoRA adapters into their kernels for decoding: W + (alpha / r) A B, then no adapter matmuls per token."""

from __future__ import annotations

from flax import nnx

from maxtext.layers import lora
from maxtext.layers.linear import DenseGeneral
from maxtext.models.decoder import Transformer


def merge_lora(model: Transformer) -> Transformer:
  """The model with every adapter merged into its kernel and removed (in place; returns the model). Outputs are unchanged
  up to float rounding; a model without adapters is returned as is. Adapters on kernels stored quantized stay
  unmerged (merging would requantize the base and change its outputs)."""
  lead = 1 if model.spec.scan_layers else 0
  for _, module in list(nnx.iter_modules(model)):
    if isinstance(module, DenseGeneral) and module.lora is not None and module.kernel_scale is None:
      adapter = module.lora
      module.kernel[...] = lora.merge(module.kernel[...], adapter.lora_a[...], adapter.lora_b[...], adapter.scale, lead=lead)
      module.lora = None
  return model
