"""Inference: a KV cache threaded through the decoder, prefill and decode steps, sampling and `generate`.

Names are imported lazily: the model layers import maxtext.inference.kv_cache, which must not pull in the models.
"""

_EXPORTS = {"Generator": "generate", "generate": "generate", "SamplingParams": "sampling"}


def __getattr__(name: str):
  if name in _EXPORTS:
    import importlib

    return getattr(importlib.import_module(f"maxtext.inference.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module 'maxtext.inference' has no attribute {name!r}")
