"""Tiny random Hugging Face models, built in code and saved to disk (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8)

FAMILY_CONFIGS = {
  "llama2": lambda: transformers.LlamaConfig(**SMALL, rope_theta=500000.0),
  "llama3.1": lambda: transformers.LlamaConfig(
    **SMALL,
    rope_parameters={
      "rope_type": "llama3",
      "rope_theta": 500000.0,
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16,
    },
  ),
  "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
  "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
  "qwen3": lambda: transformers.Qwen3Config(**SMALL, tie_word_embeddings=True),
  "gemma2": lambda: transformers.Gemma2Config(**SMALL, sliding_window=4, query_pre_attn_scalar=16),
}


def save_tiny_model(name: str, out_dir: Path, seed: int = 0) -> transformers.PreTrainedModel:
  """Build, randomise (norm scales too) and save a tiny model of a family; returns the torch model."""
  torch.manual_seed(seed)
  config = FAMILY_CONFIGS[name]()
  config._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:  # norms start at 1 (or 0 for Gemma): perturb them so a mapping mistake shows
        p.add_(0.1 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.2)
  model.save_pretrained(out_dir)
  return model


def hf_logits(model: transformers.PreTrainedModel, tokens) -> torch.Tensor:
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
