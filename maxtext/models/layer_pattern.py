"""How a family's layer pattern (maxtext.models.family.LayerKind per layer) becomes layer stacks and scan groups.

Layers of equal structure (the same kind up to its window) have the same parameters. A leading run of one structure
that never recurs (DeepSeek's first_num_dense_layers dense layers) is a stack of its own, `dense_layers`; the other
layers form the stack `layers`. Within a stack, the structures repeat with some period p:
- p = 1: one parameter stack scanned layer by layer, the windows a scan input (gemma2, gemma3, gpt_oss);
- p > 1 (e.g. a dense MLP and a MoE alternating): p parameter stacks, one per block position, scanned together as
  groups of p layers; the layers after the last whole group (the remainder) run one by one after the scan.
"""

from __future__ import annotations

import dataclasses

from maxtext.models.family import LayerKind, period

PREFIX_STACK = "dense_layers"  # the leading stack's attribute and parameter path (DeepSeek's checkpoints name it so)
MAIN_STACK = "layers"
REMAINDER = "layers_remainder"  # a p > 1 stack's layers after its last whole group


@dataclasses.dataclass(frozen=True)
class Stack:
  """Consecutive layers start .. start + len(kinds) - 1 that the model holds as one attribute, `name`."""

  name: str
  start: int
  kinds: tuple[LayerKind, ...]

  @property
  def period(self) -> int:
    """Layers per scanned group: the period of the layers' structures."""
    return period([k.structure for k in self.kinds])

  @property
  def num_groups(self) -> int:
    return len(self.kinds) // self.period

  @property
  def remainder(self) -> tuple[LayerKind, ...]:
    """The layers after the last whole group (none when p = 1: a uniform stack scans every layer)."""
    return self.kinds[self.num_groups * self.period :]

  @property
  def windows(self) -> tuple[int, ...]:
    """What each layer's attention receives: its window, or minus its chunk (LayerKind.span)."""
    return tuple(k.span for k in self.kinds)

  def locate(self, i: int) -> tuple[int | None, int]:
    """Layer i of the stack in a scanned model -> (block position j, index in position j's stack), or (None, index
    among the remainder layers)."""
    p = self.period
    if i < self.num_groups * p:
      return i % p, i // p
    return None, i - self.num_groups * p


def stacks(kinds: tuple[LayerKind, ...]) -> tuple[Stack, ...]:
  """The model's layer stacks, bottom to top. The prefix is the leading run of one structure that never recurs, and
  after it each next layer whose structure never recurs either (DeepSeek V4's hash-routed first layers: two sliding
  ones, then a compressed sparse one), unless KV-shared layers need their sources beside them; a prefix of several
  structures runs layer by layer, unscanned."""
  structures = [k.structure for k in kinds]
  lead = next((i for i, s in enumerate(structures) if s != structures[0]), len(kinds))
  if 0 < lead < len(kinds) and structures[0] not in structures[lead:]:
    sharing = any(k.kv_shared for k in kinds)  # a KV-shared layer reads its source's keys within its own stack
    while not sharing and lead < len(kinds) - 1 and structures[lead] not in structures[lead + 1 :]:
      lead += 1
    return Stack(PREFIX_STACK, 0, kinds[:lead]), Stack(MAIN_STACK, lead, kinds[lead:])
  return (Stack(MAIN_STACK, 0, kinds),)


def decode_period(stack: Stack) -> int:
  """Layers per group when decoding scans a stack: the smallest multiple of its period over which the kinds, windows
  included, repeat (each group position then keeps one stacked cache of its own length); 0 when no whole group fits."""
  p, n = stack.period, len(stack.kinds)
  d = next(d for d in range(p, n + p, p) if all(k == stack.kinds[i % d] for i, k in enumerate(stack.kinds)))
  return d if d <= n else 0


def parameter_slots(kinds: tuple[LayerKind, ...], scanned: bool) -> list[tuple[str, int | None]]:
  """Where each layer's parameters sit, bottom to top: (path prefix, index on its stacked axis, or None when not
  stacked): 'layers' (a uniform stack), 'layers/<j>' (block position j), 'layers_remainder/<i>', and '<stack>/<i>'
  unscanned or for a prefix of several structures (which runs unscanned)."""
  out: list[tuple[str, int | None]] = []
  for stack in stacks(kinds):
    listed = not scanned or (stack.period > 1 and stack.name != MAIN_STACK)
    for i in range(len(stack.kinds)):
      if listed:
        out.append((f"{stack.name}/{i}", None))
      elif stack.period == 1:
        out.append((stack.name, i))
      else:
        j, index = stack.locate(i)
        out.append((f"{stack.name}/{j}", index) if j is not None else (f"{REMAINDER}/{index}", None))
  return out
