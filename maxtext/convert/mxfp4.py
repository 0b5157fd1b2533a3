"""MXFP4 expert weights (gpt-oss's published checkpoints) -> dense tensors in Hugging Face's dequantised layout.

A tensor `<name>_blocks` uint8 [E, rows, G, 16] holds two 4-bit e2m1 values per byte (low nibble first), and
`<name>_scales` uint8 [E, rows, G] one power-of-two exponent (biased by 127) per group of 32 values:
value = e2m1 * 2^(scale - 127). Dequantised, the [E, rows, G * 32] matrix is stored transposed, [E, G * 32, rows],
which is the dense `<name>` transformers keeps (gate_up_proj [E, hidden, 2 x mlp], down_proj [E, mlp, hidden]).
Every value is exact in float32 (and bfloat16).
"""

from __future__ import annotations

import numpy as np

from maxtext.errors import ConfigError

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """blocks uint8 [E, rows, G, B], scales uint8 [E, rows, G] -> float32 [E, G * 2B, rows]."""
  if blocks.shape[:-1] != scales.shape:
    raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
  blocks = blocks.astype(np.uint8)
  values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
  values[..., 0::2] = E2M1[blocks & 0x0F]
  values[..., 1::2] = E2M1[blocks >> 4]
  values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
  e, rows = blocks.shape[:2]
  return np.ascontiguousarray(values.reshape(e, rows, -1).transpose(0, 2, 1))


def dense_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """tensors with every `<name>_blocks` / `<name>_scales` pair replaced by the dense `<name>`; others unchanged."""
  quantized = [k[: -len(BLOCKS)] for k in tensors if k.endswith(BLOCKS) and k[: -len(BLOCKS)] + SCALES in tensors]
  if not quantized:
    return tensors
  out = {k: v for k, v in tensors.items() if not any(k in (q + BLOCKS, q + SCALES) for q in quantized)}
  for name in quantized:
    blocks, scales = tensors[name + BLOCKS], tensors[name + SCALES]
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
      raise ConfigError(
        f"MXFP4 tensors '{name + BLOCKS}' ({blocks.dtype} {tuple(blocks.shape)}) and '{name + SCALES}' ({scales.dtype} {tuple(scales.shape)}) "
        "are not uint8 blocks with one uint8 scale per block; the checkpoint is damaged: re-download it"
      )
    out[name] = dequantize(blocks, scales)
  return out
