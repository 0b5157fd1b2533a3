"""Inference: a KV cache threaded through the decoder, prefill and decode steps, sampling and `generate`."""
