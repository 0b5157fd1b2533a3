"""The Hugging Face architectures and model types of the maxtext families, their activations, and the groups of model
types that config.json reading treats alike."""

from __future__ import annotations

HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "gelu": "gelu_exact", "relu": "relu"}
TO_HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "gelu_exact": "gelu", "relu": "relu"}
HF_ARCHITECTURES = {
  "llama2": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "mixtral": "MixtralForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "qwen3_moe": "Qwen3MoeForCausalLM",
  "qwen3_next": "Qwen3NextForCausalLM",
  "qwen3_5": "Qwen3_5ForCausalLM",
  "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
  "gemma": "GemmaForCausalLM",
  "gemma2": "Gemma2ForCausalLM",
  "gemma3": "Gemma3ForCausalLM",
  "gpt_oss": "GptOssForCausalLM",
  "deepseek": "DeepseekV3ForCausalLM",
  "deepseek_v32": "DeepseekV32ForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "olmo3": "Olmo3ForCausalLM",
  "llama4": "Llama4ForCausalLM",
}
HF_MODEL_TYPES = {
  "llama2": "llama",
  "mistral": "mistral",
  "mixtral": "mixtral",
  "qwen3": "qwen3",
  "qwen3_moe": "qwen3_moe",
  "qwen3_next": "qwen3_next",
  "qwen3_5": "qwen3_5_text",
  "qwen3_5_moe": "qwen3_5_moe_text",
  "gemma": "gemma",
  "gemma2": "gemma2",
  "gemma3": "gemma3_text",
  "gpt_oss": "gpt_oss",
  "deepseek": "deepseek_v3",
  "deepseek_v32": "deepseek_v32",
  "qwen2": "qwen2",
  "olmo3": "olmo3",
  "llama4": "llama4_text",
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss", "deepseek", "llama4", "deepseek_v32")
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v32")  # MLA and DeepSeekMoE; deepseek_v32 adds the lightning indexer
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # Gated DeltaNet layers beside gated full attention
QWEN3_5_MULTIMODAL = ("qwen3_5", "qwen3_5_moe")  # config.json of the vision-language checkpoints: the decoder is text_config
WINDOWED_TYPES = ("gemma2", "gemma3_text", "gpt_oss", "olmo3")  # model types whose layer_types alternate sliding and full attention
# Model types whose transformers attention puts a bias on q, k, v and o exactly when attention_bias is true (maxtext's
# attention_bias); MistralAttention and MixtralAttention have no biases whatever the key says.
BIASED_ATTENTION_TYPES = ("llama", "qwen3", "qwen3_moe", *HYBRID_TYPES, "gemma", "gemma2", "gemma3_text", "gpt_oss", "olmo3", "llama4_text")
UNBIASED_ATTENTION_TYPES = ("mistral", "mixtral")
# Gemma3TextConfig defaults for the fields a multimodal Gemma 3 config.json may leave out of its text_config.
GEMMA3_TEXT_DEFAULTS = {
  "vocab_size": 262_208,
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "num_hidden_layers": 26,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "rms_norm_eps": 1e-6,
  "rope_theta": 1_000_000.0,
  "rope_local_base_freq": 10_000.0,
  "query_pre_attn_scalar": 256,
  "sliding_window": 4096,
  "tie_word_embeddings": True,
}
GPT_OSS_SWIGLU_ALPHA = 1.702  # the sigmoid gain maxtext's clamped SwiGLU uses (MaxText's too)
