"""Where each Hugging Face decoder layer sits among our parameters: its stack, the index on the stacked axis, its kind."""

from __future__ import annotations

import dataclasses

from maxtext.config import MaxTextConfig
from maxtext.models import layer_pattern, registry
from maxtext.models.family import LayerKind


def stacks(c: MaxTextConfig) -> list[tuple[str, int, int, bool]]:
  """(our collection, first HF layer index, number of layers, dense) for each layer stack of a model whose stacks each
  hold one layer structure (maxtext.convert.hf_dir's sliced reads)."""
  n_dense = c.first_num_dense_layers
  moe = ("layers", n_dense, c.num_decoder_layers - n_dense, False)
  return [("dense_layers", 0, n_dense, True), moe] if n_dense else [moe]


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where HF layer `hf_index` sits among our parameters: under `prefix` ('layers', 'layers/<j>' of a block,
  'layers/<i>' unscanned, 'layers_remainder/<i>'), at `index` of the stacked axis (None: not stacked)."""

  hf_index: int
  kind: LayerKind
  prefix: str
  index: int | None


def slots(c: MaxTextConfig) -> list[Slot]:
  """Every decoder layer's place in the model's stacks (maxtext.models.layer_pattern), bottom to top."""
  kinds = registry.get(c.decoder_block).kinds(c)
  return [Slot(n, kind, prefix, index) for n, (kind, (prefix, index)) in enumerate(zip(kinds, layer_pattern.parameter_slots(kinds, c.scan_layers)))]
