"""MaxTextConfig: every section merged into one frozen, validated object."""

from __future__ import annotations

from maxtext.config import model_sections as m
from maxtext.config import sections as s

SECTION_CLASSES: tuple[type[s.Section], ...] = (
  s.RunInfo,
  s.Distributed,
  s.Checkpointing,
  m.DataTypes,
  m.ModelArchitecture,
  m.Attention,
  m.SplashAttention,
  m.MlaAttention,
  m.Rope,
  m.YarnRope,
  m.MoEGeneral,
  m.MoEKernels,
  m.DeepSeekMoE,
  m.Qwen3Next,
  m.Gemma4,
  m.Llama4,
  m.Llama4Vision,
  m.MTP,
  m.SparseAttention,
  m.CompressedAttention,
  m.ManifoldConstrainedHyperConnections,
  m.Logits,
  m.Quantization,
  m.VisionEncoder,
  s.HardwareAndMesh,
  s.IciParallelism,
  s.DcnParallelism,
  s.PipelineParallelism,
  s.LayoutAndSharding,
  s.DiLoCo,
  s.RematAndOffload,
  s.Optimizer,
  s.AdamW,
  m.VisionTraining,
  s.TrainingLoop,
  s.DatasetGeneral,
  s.FineTuning,
  s.RL,
  s.Tokenizer,
  s.Decoding,
  s.AOT,
  s.LoRASection,
  s.DerivedValues,
)


class MaxTextConfig(*SECTION_CLASSES):  # type: ignore[misc]
  """The whole run configuration. Build it with maxtext.config.load(argv); read-only."""

  model_config = s.SECTION_CONFIG

  def __hash__(self) -> int:  # lists inside make pydantic's field hash fail; hash the canonical JSON instead
    return hash(self.model_dump_json())


DERIVED_KEYS: frozenset[str] = frozenset(s.DerivedValues.model_fields)
USER_KEYS: tuple[str, ...] = tuple(k for k in MaxTextConfig.model_fields if k not in DERIVED_KEYS)


def section_of(key: str) -> str:
  """Name of the section class that declares a top-level key."""
  for cls in SECTION_CLASSES:
    if key in cls.model_fields:
      return cls.__name__
  raise KeyError(key)
