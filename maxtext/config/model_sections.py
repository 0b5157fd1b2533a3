"""The model's config sections, named after MaxText's (dtypes, architecture, attention, rope, MoE, MTP, mHC, logits,
quantization); the run's are in maxtext.config.sections, and MaxTextConfig merges both."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from maxtext.config.sections import Section


class DataTypes(Section):
  dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="Activation and compute dtype.")
  weight_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter storage dtype.")
  matmul_precision: Literal["default", "high", "highest"] = Field("default", description="jax.lax precision for matmuls.")


def registered_family(name: str) -> str:
  """name, if maxtext.models.registry knows the family (the built-in ones, and any registered since)."""
  from maxtext.models import registry  # the config loads before any model code otherwise

  if name not in registry.FAMILIES:
    raise ValueError(f"input should be one of {', '.join(repr(f) for f in registry.FAMILIES)}")
  return name


class ModelArchitecture(Section):
  decoder_block: Annotated[str, AfterValidator(registered_family)] = Field("llama2", description="Decoder family (block type).")
  global_parameter_scale: int = Field(1, gt=0, description="Power of two scaling layers, heads, mlp and embedding dims (see docs/config.md).")
  base_emb_dim: int = Field(2048, gt=0, description="Model (embedding) width before global_parameter_scale.")
  base_num_query_heads: int = Field(16, gt=0, description="Query heads before global_parameter_scale.")
  base_num_kv_heads: int = Field(16, gt=0, description="Key/value heads before global_parameter_scale.")
  base_mlp_dim: int = Field(7168, gt=0, description="MLP hidden width before global_parameter_scale.")
  base_num_decoder_layers: int = Field(16, gt=0, description="Decoder layers before global_parameter_scale.")
  head_dim: int = Field(128, gt=0, description="Width of each attention head.")
  mlp_activations: list[Literal["silu", "gelu", "gelu_exact", "relu", "sigmoid", "linear"]] = Field(
    ["silu", "linear"], min_length=1, max_length=2, description="MLP activations; two entries make a gated MLP (act0(x W0) * act1(x W1))."
  )
  mlp_activations_limit: float = Field(
    -1.0,
    description="gpt_oss experts' clamped SwiGLU: x W0 clipped to <= limit, x W1 to [-limit, limit], then (x W1 + 1) * x W0 * act0(1.702 x W0); -1 -> off.",
  )
  vocab_size: int = Field(32_000, gt=0, description="Vocabulary size of the embedding and output logits.")
  normalization_layer_epsilon: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
  use_qk_norm: bool = Field(
    False, description="RMSNorm over each query and key head before rotary embedding (qwen3, gemma3; olmo3: over the whole projection)."
  )
  attention_bias: bool = Field(False, description="q/k/v/o projection biases (gpt_oss; HF attention_bias of llama, qwen3, gemma, olmo3); qwen2: q/k/v only.")


class Attention(Section):
  attention: Literal["autoselected", "dot_product", "flash", "cudnn"] = Field(
    "autoselected",
    description="autoselected: the platform's fused kernel where it honours the inputs, else XLA (logged); flash: the fused kernel or a "
    "config error; cudnn: GPU cuDNN or a config error; dot_product: XLA (docs/models.md).",
  )
  sliding_window_size: int = Field(0, ge=0, description="Local attention window for sliding-window layers; 0 -> full attention.")
  attn_logits_soft_cap: float | None = Field(None, description="cap * tanh(logits / cap) on attention logits; None -> off.")
  query_pre_attn_scalar: float = Field(0.0, ge=0, description="Queries are scaled by 1/sqrt(this); 0 -> head_dim.")
  attention_sink: bool = Field(
    False, description="A learned logit per query head joins every attention softmax (gpt_oss's sinks; families whose checkpoints have them)."
  )


class SplashAttention(Section):
  sa_block_q: int = Field(512, gt=0, description="TPU splash attention: query block of the forward pass.")
  sa_block_kv: int = Field(512, gt=0, description="TPU splash attention: key/value block of the forward pass.")
  sa_block_kv_compute: int = Field(512, gt=0, description="TPU splash attention: key/value sub-block computed at once (divides sa_block_kv).")
  sa_block_q_dkv: int = Field(512, gt=0, description="TPU splash attention: query block of the dK/dV backward kernel.")
  sa_block_kv_dkv: int = Field(512, gt=0, description="TPU splash attention: key/value block of the dK/dV backward kernel.")
  sa_block_kv_dkv_compute: int = Field(512, gt=0, description="TPU splash attention: key/value sub-block of the dK/dV kernel.")
  sa_block_q_dq: int = Field(512, gt=0, description="TPU splash attention: query block of the dQ backward kernel (unfused backward).")
  sa_block_kv_dq: int = Field(512, gt=0, description="TPU splash attention: key/value block of the dQ backward kernel (unfused backward).")
  sa_use_fused_bwd_kernel: bool = Field(False, description="TPU splash attention: one backward kernel computes dQ, dK and dV.")


class MlaAttention(Section):
  q_lora_rank: int = Field(0, ge=0, description="deepseek MLA: rank of the query down-projection; 0 -> queries projected directly from the input.")
  kv_lora_rank: int = Field(512, ge=0, description="deepseek MLA: rank of the compressed key/value latent.")
  qk_nope_head_dim: int = Field(128, ge=0, description="deepseek MLA: per-head query/key width without rotary embedding.")
  qk_rope_head_dim: int = Field(64, ge=0, description="deepseek MLA: per-head query width with rotary embedding; the rotary key is shared by all heads.")
  v_head_dim: int = Field(128, ge=0, description="deepseek MLA: per-head value width.")
  mla_naive_kvcache: bool = Field(
    False,
    description="deepseek decoding: true caches per-head keys and values (the naive form); false caches the compressed latent and rotary key "
    "(kv_lora_rank + qk_rope_head_dim values per token) and decode steps attend in the latent space (absorbed form).",
  )


class Rope(Section):
  rope_type: Literal["default", "llama3.1", "yarn"] = Field(
    "default", description="Rotary embedding variant; llama3.1 adds frequency scaling; yarn (deepseek, gpt_oss) NTK-by-parts scaling."
  )
  rope_max_timescale: float = Field(10_000.0, gt=0, description="Rotary base wavelength (theta).")
  rope_scaling_factor: float = Field(8.0, gt=0, description="llama3.1 rope: frequency scaling factor.")
  rope_low_freq_factor: float = Field(1.0, gt=0, description="llama3.1 rope: low-frequency factor.")
  rope_high_freq_factor: float = Field(4.0, gt=0, description="llama3.1 rope: high-frequency factor.")
  rope_original_max_position_embeddings: int = Field(8192, gt=0, description="llama3.1 rope: original context length.")
  rope_linear_scaling_factor: float = Field(
    1.0, gt=0, description="Positions divided by this on the layers that use rope_max_timescale (gemma3: the global layers); 1 -> off."
  )
  local_rope_max_timescale: float = Field(
    -1.0, description="Rotary base of sliding-window (local) layers, which then take no linear scaling (gemma3); -1 -> rope_max_timescale."
  )
  rope_use_scale: bool = Field(True, description="llama3.1 rope: apply its frequency scaling; false -> plain rope frequencies (llama4 Maverick).")


class YarnRope(Section):
  original_max_position_embeddings: int = Field(4096, gt=0, description="yarn rope: context length the model was pretrained with.")
  rope_factor: int = Field(40, gt=0, description="yarn rope: context extension factor.")
  beta_fast: int = Field(32, gt=0, description="yarn rope: rotations above which frequencies are kept (extrapolated).")
  beta_slow: int = Field(1, gt=0, description="yarn rope: rotations below which frequencies are divided by rope_factor (interpolated).")
  mscale: float = Field(1.0, ge=0, description="yarn rope, deepseek MLA: softmax scale multiplied by (0.1 mscale ln(rope_factor) + 1)^2; 0 -> no correction.")
  rope_interleave: bool = Field(
    True, description="MLA and yarn rope: rotary pairs are interleaved (x0, x1), (x2, x3), ... rather than split in halves (other rope: always halves)."
  )
  rope_truncate: bool = Field(True, description="yarn rope: round the correction range to whole dimensions.")
  rope_attention_scaling: bool = Field(False, description="yarn rope: scale cos/sin by (0.1 ln(rope_factor) + 1).")


class MoEGeneral(Section):
  num_experts: int = Field(1, gt=0, description="Experts per MoE layer; 1 -> dense MLP.")
  num_experts_per_tok: int = Field(1, gt=0, description="Experts each token is routed to (top-k).")
  load_balance_loss_weight: float = Field(0.01, ge=0, description="Weight of the router load-balance loss added to the training loss.")
  capacity_factor: float = Field(-1.0, description="Expert capacity = capacity_factor x tokens x top-k / experts; tokens over it are dropped; -1 -> dropless.")
  ragged_buffer_factor: float = Field(
    -1.0,
    description="Expert parallelism (sparse dispatch): each device's receive buffer holds int(its tokens x top-k x factor) rows, the rest are dropped; -1 -> worst case, dropless.",
  )
  expert_gather_chunks: int = Field(
    0,
    ge=0,
    description="Sparse dispatch: a device runs its experts in this many equal chunks, one chunk's weights gathered (and their gradients "
    "reduced) at a time; 0 -> the fewest chunks that keep one gathered expert matrix within 2 GiB; 1 -> all at once.",
  )
  base_moe_mlp_dim: int = Field(-1, description="Hidden width of each routed (and shared) expert before global_parameter_scale; -1 -> base_mlp_dim.")
  norm_topk_prob: bool = Field(False, description="Renormalise the top-k routing weights to sum to 1 (mixtral always does).")


class MoEKernels(Section):
  sparse_matmul: bool = Field(
    True, description="Experts run as grouped matmuls over tokens sorted by expert; false: dense dispatch (batched matmuls over per-expert buffers)."
  )
  megablox: bool = Field(
    True,
    description="With sparse_matmul: the platform's grouped-matmul kernel (TPU: Pallas megablox; GPU/CPU: the platform policy's measured choice, "
    "docs/config.md); false: jax.lax.ragged_dot.",
  )
  use_tokamax_gmm: bool = Field(False, description="With sparse_matmul and megablox: tokamax's grouped matmul (pip install tokamax).")
  wi_tile_fwd_batch_seq: int = Field(512, gt=0, description="megablox: rows (routed tokens) block of the wi forward grouped matmul.")
  wi_tile_fwd_embed_dim: int = Field(1024, gt=0, description="megablox: embed block of the wi forward grouped matmul.")
  wi_tile_fwd_mlp_dim: int = Field(1024, gt=0, description="megablox: mlp block of the wi forward grouped matmul.")
  wi_tile_dlhs_batch_seq: int = Field(512, gt=0, description="megablox: rows (routed tokens) block of the wi input-gradient grouped matmul.")
  wi_tile_dlhs_embed_dim: int = Field(1024, gt=0, description="megablox: embed block of the wi input-gradient grouped matmul.")
  wi_tile_dlhs_mlp_dim: int = Field(1024, gt=0, description="megablox: mlp block of the wi input-gradient grouped matmul.")
  wi_tile_drhs_batch_seq: int = Field(512, gt=0, description="megablox: rows (routed tokens) block of the wi weight-gradient grouped matmul.")
  wi_tile_drhs_embed_dim: int = Field(1024, gt=0, description="megablox: embed block of the wi weight-gradient grouped matmul.")
  wi_tile_drhs_mlp_dim: int = Field(1024, gt=0, description="megablox: mlp block of the wi weight-gradient grouped matmul.")
  wo_tile_fwd_batch_seq: int = Field(512, gt=0, description="megablox: rows (routed tokens) block of the wo forward grouped matmul.")
  wo_tile_fwd_embed_dim: int = Field(1024, gt=0, description="megablox: embed block of the wo forward grouped matmul.")
  wo_tile_fwd_mlp_dim: int = Field(1024, gt=0, description="megablox: mlp block of the wo forward grouped matmul.")
  wo_tile_dlhs_batch_seq: int = Field(512, gt=0, description="megablox: rows (routed tokens) block of the wo input-gradient grouped matmul.")
  wo_tile_dlhs_embed_dim: int = Field(1024, gt=0, description="megablox: embed block of the wo input-gradient grouped matmul.")
  wo_tile_dlhs_mlp_dim: int = Field(1024, gt=0, description="megablox: mlp block of the wo input-gradient grouped matmul.")
  wo_tile_drhs_batch_seq: int = Field(512, gt=0, description="megablox: rows (routed tokens) block of the wo weight-gradient grouped matmul.")
  wo_tile_drhs_embed_dim: int = Field(1024, gt=0, description="megablox: embed block of the wo weight-gradient grouped matmul.")
  wo_tile_drhs_mlp_dim: int = Field(1024, gt=0, description="megablox: mlp block of the wo weight-gradient grouped matmul.")


class DeepSeekMoE(Section):
  first_num_dense_layers: int = Field(0, ge=0, description="The first this many layers use a dense MLP (base_mlp_dim) instead of experts.")
  shared_experts: int = Field(0, ge=0, description="Always-on experts per MoE layer, fused into one MLP of width shared_experts x moe_mlp_dim.")
  routed_scaling_factor: float = Field(1.0, description="Routed experts' weights are multiplied by this.")
  routed_score_func: Literal["", "softmax", "sigmoid", "sqrtsoftplus"] = Field(
    "", description="Router scores: softmax (''), sigmoid (deepseek), or sqrtsoftplus, sqrt(softplus(logit)) (deepseek4)."
  )
  routed_bias: bool = Field(
    False,
    description="Per-expert router bias: with sigmoid scores a score-correction bias on the scores that choose experts (not the weights; deepseek), "
    "with softmax a trained bias on the router logits (gpt_oss).",
  )
  routed_bias_update_rate: float = Field(
    0.0, ge=0, description="Aux-loss-free balancing: each step bias += rate x sign(mean load - expert load); 0 -> bias not updated."
  )
  mlp_bias: bool = Field(False, description="Biases on every routed expert's projections (gpt_oss).")
  n_routing_groups: int = Field(-1, description="Group-limited routing: experts split into this many groups; -1 -> off.")
  topk_routing_group: int = Field(-1, description="Group-limited routing: tokens choose experts only in their best this many groups; -1 -> off.")


class Qwen3Next(Section):
  inhomogeneous_layer_cycle_interval: int = Field(
    1, gt=0, description="qwen3_next: every this many layers one is full (gated) attention, the others Gated DeltaNet (HF full_attention_interval)."
  )
  gdn_conv_kernel_dim: int = Field(4, gt=0, description="Gated DeltaNet: taps of the causal depthwise convolution over q, k, v.")
  gdn_key_head_dim: int = Field(128, gt=0, description="Gated DeltaNet: width of each query/key head.")
  gdn_value_head_dim: int = Field(128, gt=0, description="Gated DeltaNet: width of each value head.")
  gdn_num_key_heads: int = Field(16, gt=0, description="Gated DeltaNet: query/key heads.")
  gdn_num_value_heads: int = Field(32, gt=0, description="Gated DeltaNet: value heads, a multiple of gdn_num_key_heads.")
  gdn_chunk_size: int = Field(64, gt=0, description="Gated DeltaNet: tokens per chunk of the chunked (training, prefill) form.")
  partial_rotary_factor: float = Field(1.0, gt=0, le=1, description="Fraction of each attention head's features that rotate (qwen3_next: 0.25).")


class Llama4(Section):
  interleave_moe_layer_step: int = Field(
    1, gt=0, description="llama4: every this many layers one is MoE (layers step-1, 2 step-1, ...), the others dense MLPs of mlp_dim."
  )
  nope_layer_interval: int = Field(-1, description="llama4: every this many layers one takes no rope (NoPE) and attends globally; -1 -> none.")
  chunk_attn_window_size: int = Field(0, ge=0, description="llama4: the rope layers attend only within chunks of this many positions (causal); 0 -> off.")
  temperature_tuning: bool = Field(
    False, description="llama4: NoPE layers scale queries by 1 + temperature_tuning_scale ln(1 + floor((pos + 1) / floor_scale))."
  )
  temperature_tuning_scale: float = Field(0.1, ge=0, description="llama4: temperature tuning's scale (Hugging Face attn_scale).")
  temperature_tuning_floor_scale: float = Field(8192.0, gt=0, description="llama4: temperature tuning's position divisor (Hugging Face floor_scale).")


class Gemma4(Section):
  global_head_dim: int = Field(0, ge=0, description="gemma4: width of each attention head of the global layers; 0 -> head_dim.")
  global_num_kv_heads: int = Field(0, ge=0, description="gemma4: key/value heads of the global layers; 0 -> num_kv_heads.")
  share_kv_projections: bool = Field(
    False, description="gemma4: the global layers have no value projection; their values are the key projection before its norm and rope (HF attention_k_eq_v)."
  )
  v_norm_with_scale: bool = Field(True, description="gemma4: the RMSNorm on each value head has a learned scale (Hugging Face's has none: false).")
  global_rope_max_timescale: float = Field(-1.0, description="gemma4: rotary base of the global layers; -1 -> rope_max_timescale.")
  global_rope_proportion: float = Field(
    0.25, gt=0, le=1, description="gemma4: the first this fraction of each global head's frequency pairs rotate, the rest stay (proportional rope)."
  )
  local_rope_proportion: float = Field(1.0, gt=0, le=1, description="gemma4: the same fraction for the sliding-window layers.")
  hidden_size_per_layer_input: int = Field(
    0, ge=0, description="gemma4: width of the per-layer input embedding each layer gates in after its MLP (E2B/E4B: 256); 0 -> none."
  )
  vocab_size_per_layer_input: int = Field(0, ge=0, description="gemma4: rows of the per-layer input embedding table; 0 -> vocab_size.")
  num_kv_shared_layers: int = Field(
    0, ge=0, description="gemma4: the last this many layers attend with the keys and values of the last earlier layer of their kind and cache none."
  )
  use_double_wide_mlp: bool = Field(False, description="gemma4: the MLP of the KV-shared layers is 2 x mlp_dim wide (E2B).")


class MTP(Section):
  mtp_num_layers: int = Field(0, ge=0, description="Multi-token prediction modules (layer k predicts token t+1+k); training-only extra loss; 0 -> off.")
  mtp_loss_scaling_factor: float = Field(0.1, ge=0, description="Weight of the mean multi-token-prediction loss added to the training loss.")


class ManifoldConstrainedHyperConnections(Section):
  mhc_expansion_rate: int = Field(1, gt=0, description="Residual streams n; 1 -> ordinary residual network.")
  sinkhorn_iterations: int = Field(20, gt=0, description="Sinkhorn-Knopp iterations projecting H_res onto doubly-stochastic matrices.")


class CompressedAttention(Section):
  """DeepSeek V4 (decoder_block=deepseek4): compressed attention, hash routing and mHC's V4 form; MaxText's keys, and
  csa_compress_ratio and hc_eps (Hugging Face's) where MaxText fixes the value."""

  compress_ratios: list[int] = Field(
    default_factory=list, description="deepseek4: each layer's compress rate, one per layer; 0 -> sliding window only, csa_compress_ratio -> CSA, others HCA."
  )
  csa_compress_ratio: int = Field(
    4, gt=0, description="deepseek4: the compress rate of the compressed sparse attention layers (overlapping, with the indexer)."
  )
  o_groups: int = Field(0, ge=0, description="deepseek4: head groups of the grouped low-rank output projection.")
  o_lora_rank: int = Field(0, ge=0, description="deepseek4: each output group's low rank.")
  first_num_hash_layers: int = Field(0, ge=0, description="deepseek4: the first this many layers route tokens to experts by token id (a tid2eid table).")
  compressed_rope_max_timescale: float = Field(
    160_000.0, gt=0, description="deepseek4: rope base of the compressed layers (with rope_type's scaling); the sliding ones use rope_max_timescale, unscaled."
  )
  hc_eps: float = Field(1e-6, gt=0, description="deepseek4: mHC's floor added to H_pre, the Sinkhorn sums and the final collapse's weights (HF hc_eps).")


class Logits(Section):
  logits_via_embedding: bool = Field(False, description="Tie the output projection to the token embedding.")
  normalize_embedding_logits: bool = Field(False, description="With tied embeddings, divide logits by sqrt(emb_dim).")
  final_logits_soft_cap: float | None = Field(None, description="cap * tanh(logits / cap) on output logits; None -> off.")
  logits_dot_in_fp32: bool = Field(
    False, description="Output logits matmul on float32 operands with float32 logits; false -> dtype operands, logits rounded to dtype, then float32."
  )


class Quantization(Section):
  quantization: Literal["", "int8", "fp8", "fp8_full", "int4w"] = Field(
    "",
    description="Matmul quantization with qwix (docs/quantization.md): int8 weights and activations; fp8 e4m3 forward, e5m2 gradients; "
    "fp8_full fp8 with the calibration keys (static scaling); int4w int4 weights (LoRA base, decode); '' off.",
  )
  quantization_local_shard_count: int = Field(
    -1, description="fp8/fp8_full: the weight gradient's quantized contraction (token) axis gets this many scale tiles; -1 -> one per slice."
  )
  weight_quantization_calibration_method: str = Field(
    "absmax", description="fp8_full: weight scale: absmax[,s], rms,s or fixed,c (static range [-c, c]; s, c > 0); other modes use absmax."
  )
  act_quantization_calibration_method: str = Field("absmax", description="fp8_full: activation scale, as weight_quantization_calibration_method.")
  bwd_quantization_calibration_method: str = Field("absmax", description="fp8_full: gradient scale, as weight_quantization_calibration_method.")
  quantize_logits_proj: bool = Field(False, description="Quantize the output (logits) projection too; otherwise it stays in the compute dtype.")
  quantize_kvcache: bool = Field(False, description="decode: keep keys and values in kv_quant_dtype with scales.")
  kv_quant_dtype: Literal["int8", "int4"] = Field("int8", description="decode: the quantized KV cache's integer type.")
  kv_quant_axis: Literal["", "dkv", "heads_and_dkv"] = Field(
    "heads_and_dkv", description="decode: axes one KV-cache scale covers: dkv (each head's vector), heads_and_dkv (all heads of a token)."
  )


class VisionEncoder(Section):
  use_multimodal: bool = Field(
    False, description="Images in: the family's vision tower and projector put soft tokens at the image placeholders (gemma3; docs/vision.md)."
  )
  image_size_for_vit: int = Field(896, gt=0, description="Vision tower: square input side in pixels; images are resized to it.")
  patch_size_for_vit: int = Field(14, gt=0, description="Vision tower: side of the square patches (the patch embedding's stride).")
  hidden_size_for_vit: int = Field(1408, gt=0, description="Vision tower: width.")
  intermediate_size_for_vit: int = Field(5632, gt=0, description="Vision tower: MLP hidden width.")
  num_hidden_layers_for_vit: int = Field(34, gt=0, description="Vision tower: encoder blocks.")
  num_attention_heads_for_vit: int = Field(16, gt=0, description="Vision tower: attention heads.")
  remat_policy_for_vit: Literal["full", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj", "none"] = Field(
    "minimal", description="What each vision tower block saves for the backward pass (as remat_policy)."
  )
  mm_tokens_per_image: int = Field(256, gt=0, description="Soft tokens per image (a square whose side divides the patches per side); gemma3: 256.")
  image_token_id: int = Field(262144, ge=0, description="The placeholder token id that image soft tokens replace (HF image_token_index).")
  max_num_images_per_example: int = Field(-1, description="Images one example may carry; more is a data error; -1 -> no limit.")
  image_placeholder: str = Field("<|image|>", description="The text marking an image's place in image-text data (each becomes mm_tokens_per_image image ids).")
  train_image_column: str = Field(
    "image", description="use_multimodal: the train records' column of images (one, or a list in place order): paths relative to the file or data URIs."
  )
  image_path: str = Field("", description="decode: image files (comma-separated) for the prompt's image_placeholder places, in order (use_multimodal).")
  eval_image_column: str = Field("image", description="use_multimodal: the eval records' column of images, as train_image_column.")
  # Qwen3-VL (vision_encoder_block=qwen3_vl; docs/vision.md)
  vision_encoder_block: Literal["", "qwen3_vl"] = Field(
    "", description="use_multimodal: the vision tower; '' the family's own (gemma3: SigLIP), qwen3_vl: Qwen3-VL's (decoder_block qwen3 or qwen3_moe)."
  )
  temporal_patch_size_for_vit: int = Field(2, gt=0, description="qwen3_vl tower: frames per patch (an image fills them all).")
  spatial_merge_size_for_vit: int = Field(2, gt=0, description="qwen3_vl tower: m x m neighbouring patches merge into one text token.")
  out_hidden_size_for_vit: int = Field(512, gt=0, description="qwen3_vl tower: the merged tokens' width (the text model's emb_dim).")
  num_position_embeddings_for_vit: int = Field(1024, gt=0, description="qwen3_vl tower: learned positions, a square G x G table resampled per image.")
  deepstack_visual_indexes_for_vit: list[int] = Field(
    default_factory=list, description="qwen3_vl tower: blocks whose merged features are added after decoder layers 0, 1, ... (DeepStack)."
  )
  min_pixels_for_vit: int = Field(
    65536, gt=0, description="qwen3_vl: images smaller in area are resized up (aspect kept); image_size_for_vit^2 bounds them above."
  )
  max_patches_per_row_for_vit: int = Field(
    0, ge=0, description="qwen3_vl training: image patches a row holds (a fixed shape; packing fills it); 0: one image of image_size_for_vit^2 pixels."
  )
  use_mrope: bool = Field(False, description="Multimodal rope (Qwen3-VL): image tokens rotate by (time, row, column) positions, interleaved per mrope_section.")
  mrope_section: list[int] = Field(default_factory=lambda: [24, 20, 20], description="use_mrope: rotary frequency pairs of the time, height and width axes.")


class SparseAttention(Section):
  """DeepSeek Sparse Attention (decoder_block=deepseek_v32: MLA with the lightning indexer); MaxText's keys."""

  use_indexer: bool = Field(
    False, description="DeepSeek Sparse Attention: MLA attends to the indexer's top-k keys; true exactly for decoder_block=deepseek_v32."
  )
  indexer_n_heads: int = Field(64, gt=0, description="DeepSeek Sparse Attention: the indexer's query heads.")
  indexer_head_dim: int = Field(128, gt=0, description="DeepSeek Sparse Attention: the indexer's query/key width (its first qk_rope_head_dim features rotate).")
  indexer_topk: int = Field(2048, gt=0, description="DeepSeek Sparse Attention: keys each query attends to (all of them when fewer are visible).")
  indexer_sparse_training: bool = Field(
    False,
    description="DeepSeek Sparse Attention with indexer_loss_scaling_factor > 0: false -> dense warm-up (dense attention, only the indexer trains, "
    "KL over all keys); true -> sparse training (top-k attention, KL over the selected keys, the rest trains on the LM loss).",
  )
  indexer_loss_scaling_factor: float = Field(
    0.0, ge=0, description="DeepSeek Sparse Attention: weight of the indexer's KL loss in the training loss; 0 -> off."
  )


class VisionTraining(Section):
  """How the vision tower trains (use_multimodal); docs/vision.md."""

  freeze_vision_encoder_params: bool = Field(
    False,
    description="The vision tower gets no gradient and no optimizer state (its projector still trains); MaxText's key (its default is true).",
  )
  vision_learning_rate_scale: float = Field(
    1.0, gt=0, description="The vision tower's learning rate as a multiple of learning_rate (use_multimodal, tower not frozen); 1 -> the same."
  )


class Llama4Vision(Section):
  """Llama 4's vision tower and projector (use_multimodal with decoder_block=llama4; MaxText's keys; docs/vision.md)."""

  tile_size_for_vit: int = Field(336, gt=0, description="llama4 vision: the tiles' side in pixels (images are cut into tiles of it).")
  pixel_shuffle_ratio_for_vit: float = Field(0.5, gt=0, le=1, description="llama4 vision: the pixel shuffle's ratio (each tile's tokens shrink by its square).")
  projector_input_dim_for_vit: int = Field(4096, gt=0, description="llama4 vision: the vision adapter MLP's hidden width.")
  projector_output_dim_for_vit: int = Field(4096, gt=0, description="llama4 vision: the vision adapter MLP's output width (= projector_input_dim_for_vit).")
  vision_output_dim_for_vit: int = Field(4096, gt=0, description="llama4 vision: the projector's input width (= projector_output_dim_for_vit).")
  rope_theta_for_vit: float = Field(10000.0, gt=0, description="llama4 vision: the base of the tower's 2-D rope.")
  max_num_tiles_for_vit: int = Field(
    16, gt=0, description="llama4 vision: the most tiles an image is cut into, global tile aside (the processor's max_patches)."
  )
