"""What the FLOP count (maxtext.counting) needs of a vision component: its stages bottom to top, each a parameter
subtree with the tokens per image its matmuls see, its attention scores, and the images one row runs.

A stage's parameters cost 2 FLOPs per entry per token forward, 2 more for their gradient when they train and 2 for
their input's gradient when something below them trains (as the decoder's weights). Position tables and class tokens
are additions, not matmuls, and are left out. The scores: per block 4 P^2 E forward (q k^T and the weighted sum over
P tokens of width E = heads x head_dim; bidirectional, nothing masked), twice that backward when the tower trains.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Stage:
  path: tuple[str, ...]  # under the Transformer's `vision` module
  tokens: int  # tokens per image through the stage's matmuls


@dataclasses.dataclass(frozen=True)
class VisionCost:
  stages: tuple[Stage, ...]  # bottom to top
  score_flops: int  # forward FLOPs of the attention scores per image, all blocks
  images_per_row: int  # images (or tiles) the compiled step encodes per row of max_target_length tokens


def cost(spec, length: int, max_patches: int = 0) -> VisionCost | None:
  """The vision spec's stages for rows of `length` tokens (spec: Gemma3VisionSpec, Llama4VisionSpec or
  Qwen3VLEncoderSpec). Qwen3-VL's tower runs on each row's patch budget (max_patches, 0: its default) as one image:
  all P patches through the embedding and blocks, P / m^2 merged tokens through the mergers, the scores over P x P
  (each frame masked from the others, the products computed all the same)."""
  from maxtext.vision.gemma3_encoder import Gemma3VisionSpec
  from maxtext.vision.qwen3_vl_encoder import Qwen3VLEncoderSpec, patch_budget

  if isinstance(spec, Qwen3VLEncoderSpec):
    t, p = spec.tower, patch_budget(spec, max_patches)
    merged = p // spec.merge_size**2
    stages = (Stage(("tower", "patch_embed"), p), Stage(("tower", "blocks"), p))
    if t.deepstack_indexes:
      stages += (Stage(("tower", "deepstack_mergers"), merged),)
    stages += (Stage(("tower", "merger"), merged),)
    return VisionCost(stages, t.num_layers * 4 * p * p * t.emb_dim, 1)

  if isinstance(spec, Gemma3VisionSpec):
    t, p = spec.tower, spec.tower.num_patches
    stages = (Stage(("tower", "patch_embed"), p), Stage(("tower", "blocks"), p), Stage(("tower", "post_norm"), p), Stage(("projector",), spec.tokens_per_image))
    return VisionCost(stages, t.num_layers * 4 * p * p * t.emb_dim, max(1, length // spec.tokens_per_image))
  from maxtext.vision.llama4_vision import Llama4VisionSpec

  if isinstance(spec, Llama4VisionSpec):
    p, t = spec.num_patches, spec.tokens_per_image
    stages = (
      Stage(("tower", "patch_embed"), p),
      Stage(("tower", "pre_norm"), p + 1),
      Stage(("tower", "blocks"), p + 1),
      Stage(("tower", "post_norm"), p + 1),
      Stage(("tower", "adapter"), t),
      Stage(("projector",), t),
    )
    return VisionCost(stages, spec.num_layers * 4 * (p + 1) ** 2 * spec.emb_dim, max(1, length // t))
  return None
