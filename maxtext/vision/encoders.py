"""The vision component a spec builds (maxtext.models.specs.vision makes the spec; the Transformer holds the module)."""

from __future__ import annotations

from flax import nnx

from maxtext.platform import Policy
from maxtext.vision.gemma3_encoder import Gemma3VisionEncoder, Gemma3VisionSpec
from maxtext.vision.llama4_vision import Llama4VisionEncoder, Llama4VisionSpec


def vision_encoder(spec: Gemma3VisionSpec | Llama4VisionSpec, policy: Policy, rngs: nnx.Rngs) -> nnx.Module:
  """encoder(images [B, M, S, S, 3]) -> soft tokens [B, M * spec.tokens_per_image, E_text], for the spec's family."""
  if isinstance(spec, Llama4VisionSpec):
    return Llama4VisionEncoder(spec, policy=policy, rngs=rngs)
  return Gemma3VisionEncoder(spec, policy=policy, rngs=rngs)
