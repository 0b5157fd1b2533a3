"""OLMo 3: RMSNorm after each branch only (no pre-norms), query/key RMSNorm over the whole projection (not per head),
and three sliding-window layers per global layer; with local_rope_max_timescale the sliding layers rotate with plain
rope while the global layers take rope_type's scaling (YaRN in the long-context checkpoints)."""

from maxtext.models.family import POST_ONLY_HF_NORMS, Family, standard_pattern

FAMILY = Family(
  name="olmo3",
  hf_model_types=("olmo3",),
  post_norms=True,
  pre_norms=False,
  qk_norm_per_head=False,
  layer_pattern=standard_pattern(local_per_global=3),  # HF layer_types: sliding, sliding, sliding, full, repeated
  hf_norm_names=dict(POST_ONLY_HF_NORMS),
)
