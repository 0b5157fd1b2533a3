"""gpt-oss: sliding-window and global layers alternate, a learned sink logit per head in every softmax, biases on
q/k/v/o, GQA with YaRN rope; a top-k router with bias and a softmax over the chosen experts, experts with biases and
a clamped SwiGLU."""

from maxtext.models.family import Family, standard_pattern

FAMILY = Family(
  name="gpt_oss",
  hf_model_types=("gpt_oss",),
  layer_pattern=standard_pattern(local_per_global=1),  # even layers sliding (HF layer_types "sliding_attention"), odd layers full
  attention_sinks=True,
  clamped_glu=True,
)
