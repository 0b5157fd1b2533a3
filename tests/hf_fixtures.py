"""Tiny random Hugging Face models, built in code and saved to disk (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32, "beta_slow": 1}
LINEAR = {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}


FAMILY_CONFIGS = {
  "llama2": lambda: transformers.LlamaConfig(**SMALL, rope_theta=500000.0),
  "llama3.1": lambda: transformers.LlamaConfig(
    **SMALL,
    attention_bias=True,  # q/k/v/o biases, as some Llama-architecture checkpoints have
    rope_parameters={
      "rope_type": "llama3",
      "rope_theta": 500000.0,
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16,
    },
  ),
  "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=4, attention_bias=True),  # MistralAttention ignores attention_bias
  "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
  "qwen3": lambda: transformers.Qwen3Config(**SMALL, tie_word_embeddings=True, attention_bias=True),
  "gemma": lambda: transformers.GemmaConfig(**{**SMALL, "num_key_value_heads": 1}, hidden_act="gelu"),  # MQA and the releases' legacy "gelu"
  "gemma2": lambda: transformers.Gemma2Config(**SMALL, sliding_window=4, query_pre_attn_scalar=16),
  "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
    **SMALL, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]
  ),
  "gemma3": lambda: transformers.Gemma3TextConfig(
    **{**SMALL, "num_hidden_layers": 7},  # one scanned group of 6 (5 local, 1 global) and a local tail layer
    sliding_window=4,
    query_pre_attn_scalar=16,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": LINEAR},
  ),
  "gpt_oss": lambda: transformers.GptOssConfig(
    **{**SMALL, "intermediate_size": 16},
    sliding_window=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    swiglu_limit=1.0,  # low enough that the clamps act on these activations
    max_position_embeddings=16,
    rope_parameters={**YARN, "rope_theta": 150000.0, "truncate": False},
  ),
  "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),  # q/k/v biases, none on o_proj
  "olmo3": lambda: transformers.Olmo3Config(
    **{**SMALL, "num_hidden_layers": 5},  # one scanned group of 4 (3 sliding, 1 full) and a sliding tail layer
    sliding_window=4,
    max_position_embeddings=16,
    # YaRN (with its cos/sin scaling) on the full layer, plain rope of another base on the sliding ones
    rope_parameters={"full_attention": {**YARN, "rope_theta": 500000.0}, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
  ),
  "deepseek": lambda: _deepseek(q_lora_rank=12),
  "deepseek_q0": lambda: _deepseek(q_lora_rank=None, norm_topk_prob=False),
  # Plain rope (no YaRN), half-split rope pairs, one routing group (as Kimi K2's config.json has).
  "deepseek_plain": lambda: _deepseek(q_lora_rank=None, rope={"rope_type": "default", "rope_theta": 10000.0}, rope_interleave=False, n_group=1, topk_group=1),
}


def _deepseek(q_lora_rank: int | None, norm_topk_prob: bool = True, rope: dict | None = None, **extra) -> transformers.DeepseekV3Config:
  """Tiny DeepSeek V3: 1 dense + 2 MoE layers, 8 experts in 4 groups (top-2 groups), a shared expert, MLA, YaRN.

  q_lora_rank=12 compresses queries; None projects them directly (maxtext's q_lora_rank=0). The first uses
  DeepSeek's mscale = mscale_all_dim (softmax-scale correction), the second HF's default cos/sin scaling; rope
  replaces YaRN and extra sets other DeepseekV3Config fields (rope_interleave, n_group, topk_group).
  """
  mscale = {"mscale": 1.0, "mscale_all_dim": 1.0} if q_lora_rank else {}
  groups = {"n_group": 4, "topk_group": 2, **extra}
  return transformers.DeepseekV3Config(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=norm_topk_prob,
    q_lora_rank=q_lora_rank,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    max_position_embeddings=16,
    rope_parameters=rope or {**YARN, **mscale},
    **groups,
  )


def save_tiny_model(name: str, out_dir: Path, seed: int = 0) -> transformers.PreTrainedModel:
  """Build, randomise (norm scales too) and save a tiny model of a family; returns the torch model."""
  torch.manual_seed(seed)
  config = FAMILY_CONFIGS[name]()
  config._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
  away_from_init(model)
  model.save_pretrained(out_dir)
  return model


def away_from_init(model: transformers.PreTrainedModel) -> None:
  """Random weights, and every vector (norm scales, biases, A_log, dt_bias) moved off its init so a mapping mistake
  shows; DeepSeek's routing bias nonzero (it must reach expert choice); Gemma 4's layer scalars off 1."""
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.2)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.05 * torch.randn_like(b))
      elif name.endswith("layer_scalar"):
        b.uniform_(0.5, 1.5)


def hf_logits(model: transformers.PreTrainedModel, tokens) -> torch.Tensor:
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
