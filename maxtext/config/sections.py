"""Pydantic config sections, named after MaxText's; merged into MaxTextConfig. The model's own sections (dtypes,
architecture, attention, rope, MoE, MTP, mHC, logits, quantization) are in maxtext.config.model_sections.

Every field has a type, a default and a one-line description. configs/base.yml
repeats each default with a comment; tests/test_config_schema.py keeps the two equal.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat

# Every section's settings (and MaxTextConfig's): unknown keys are errors, values read-only, and no float key (nor a
# float in a list) takes inf or nan: a rate, weight, fraction or threshold that is not finite fails or degenerates only
# once the run has started.
SECTION_CONFIG = ConfigDict(extra="forbid", frozen=True, validate_default=True, coerce_numbers_to_str=True, allow_inf_nan=False)


class Section(BaseModel):
  """Base of every section: unknown keys are errors, values are read-only, floats are finite."""

  model_config = SECTION_CONFIG


class RunInfo(Section):
  run_name: str = Field("", description="Name of the run; empty -> '<model_name>_<YYYY-mm-dd-HH-MM>'.")
  model_name: str = Field("default", description="Loads configs/models/<model_name>.yml over the base values; 'default' loads none.")
  override_model_config: bool = Field(False, description="Allow command-line keys to override values the model file sets.")
  base_output_directory: str = Field("maxtext_output", description="Root of run outputs: <base>/<run_name>/{checkpoints,metrics,tensorboard}.")
  hardware: Literal["auto", "cpu", "gpu", "gpu_multiprocess", "tpu"] = Field(
    "auto", description="Expected JAX backend; 'auto' uses whatever JAX finds. A mismatch is an error."
  )
  log_period: int = Field(100, gt=0, description="Flush TensorBoard and the metrics file every this many steps.")
  enable_tensorboard: bool = Field(True, description="Write TensorBoard event files under the run's tensorboard dir.")
  metrics_file: str = Field("", description="If set, append one JSON line of metrics per step to this file.")
  enable_goodput_recording: bool = Field(
    False, description="Split the run's wall time into productive steps, init, compile, data, checkpoints and lost steps: summary line and <run>/goodput.json."
  )
  monitor_goodput: bool = Field(False, description="Log the running goodput figure every log_period steps.")
  enable_wandb: bool = Field(False, description="Log the metrics, the resolved config and the training-curves PNG to Weights & Biases (process 0).")
  wandb_project_name: str = Field("maxtext", description="W&B project of the run.")
  wandb_run_name: str = Field("", description="W&B display name of the run; empty -> run_name.")
  init_weights_seed: int = Field(0, description="PRNG seed for parameter initialisation.")
  device_peak_tflops: float = Field(
    0.0,
    ge=0,
    description="Peak TFLOP/s per device for MFU, in the run's matmul format (int8 TOP/s with quantization=int8); 0 -> chip table, or measured once on CPU.",
  )


class Distributed(Section):
  skip_jax_distributed_system: bool = Field(False, description="Do not call jax.distributed.initialize.")
  jax_coordinator_address: str = Field("", description="host:port of process 0 for multi-process runs; empty -> auto-detect (TPU VM, GKE).")
  jax_num_processes: int = Field(0, ge=0, description="Number of processes with jax_coordinator_address; 0 -> auto.")
  jax_process_id: int = Field(-1, ge=-1, description="This process's id with jax_coordinator_address; -1 -> auto.")
  jax_distributed_initialization_timeout: int = Field(300, gt=0, description="Seconds to wait for all processes to join.")


class Checkpointing(Section):
  enable_checkpointing: bool = Field(True, description="Save Orbax checkpoints of the train state.")
  async_checkpointing: bool = Field(True, description="Write checkpoints in the background while training goes on.")
  checkpoint_period: int = Field(10_000, gt=0, description="Save a checkpoint every this many steps.")
  max_num_checkpoints_to_keep: int | None = Field(None, description="Keep at most this many checkpoints (at least 1); None keeps all.")
  save_checkpoint_on_completion: bool = Field(True, description="Save a checkpoint after the last step.")
  load_parameters_path: str = Field(
    "", description="Orbax params checkpoint to start from (fresh optimizer, step 0): a step directory, or a run's checkpoints/ (its newest step)."
  )
  load_full_state_path: str = Field("", description="Orbax full-state checkpoint to start from (params, optimizer, step).")
  save_quantized_params_path: str = Field(
    "", description="decode: write the loaded parameters, their kernels quantized per `quantization` (with scales), as a params checkpoint here."
  )
  checkpoint_is_quantized: bool = Field(
    False, description="load_parameters_path holds quantized kernels and scales (save_quantized_params_path output), loaded as they are."
  )


class HardwareAndMesh(Section):
  mesh_axes: list[str] = Field(
    ["data", "stage", "fsdp", "sequence", "context", "tensor", "expert"], min_length=1, description="Mesh axis names, outermost first."
  )
  context_parallel_strategy: Literal["all_gather", "ring"] = Field(
    "all_gather",
    description="Attention over a context-sharded sequence: all_gather (keys and values gathered, queries stay sharded) or ring "
    "(key/value blocks rotate with ppermute, merged by log-sum-exp).",
  )
  context_parallel_load_balance: bool = Field(
    True, description="Reorder the sequence (dual-chunk swap) so every context shard gets equal causal work; undone for per-token outputs."
  )


class IciParallelism(Section):
  ici_data_parallelism: int = Field(1, description="Data parallelism within a slice; -1 fills.")
  ici_pipeline_parallelism: int = Field(1, description="Pipeline stages within a slice (mesh axis 'stage'); -1 fills.")
  ici_fsdp_parallelism: int = Field(-1, description="Fully sharded data parallelism within a slice; -1 fills.")
  ici_sequence_parallelism: int = Field(1, description="Sequence parallelism within a slice; -1 fills.")
  ici_context_parallelism: int = Field(1, description="Context parallelism within a slice (sequence split, attention gathers or rings K/V); -1 fills.")
  ici_tensor_parallelism: int = Field(1, description="Tensor parallelism within a slice; -1 fills.")
  ici_expert_parallelism: int = Field(1, description="Expert parallelism within a slice; -1 fills.")
  ici_diloco_parallelism: int = Field(1, description="DiLoCo replica groups within a slice (mesh axis 'diloco', with enable_diloco); -1 fills.")


class DcnParallelism(Section):
  dcn_data_parallelism: int = Field(-1, description="Data parallelism across slices; -1 fills.")
  dcn_pipeline_parallelism: int = Field(1, description="Pipeline stages across slices (mesh axis 'stage'); -1 fills.")
  dcn_fsdp_parallelism: int = Field(1, description="FSDP across slices; -1 fills.")
  dcn_sequence_parallelism: int = Field(1, description="Sequence parallelism across slices; -1 fills.")
  dcn_context_parallelism: int = Field(1, description="Context parallelism across slices; -1 fills.")
  dcn_tensor_parallelism: int = Field(1, description="Tensor parallelism across slices; -1 fills.")
  dcn_expert_parallelism: int = Field(1, description="Expert parallelism across slices; -1 fills.")
  dcn_diloco_parallelism: int = Field(1, description="DiLoCo replica groups across slices (mesh axis 'diloco', with enable_diloco); -1 fills.")


class PipelineParallelism(Section):
  num_layers_per_pipeline_stage: int = Field(
    1, gt=0, description="Consecutive layers a stage runs per visit; below layers/stages the schedule is circular (num_pipeline_repeats > 1)."
  )
  pipeline_parallel_layers: int = Field(
    -1,
    description="Pipeline only the first this many main-stack decoder layers; the rest run after the pipeline, on every stage; -1 -> all of them.",
  )
  num_pipeline_repeats: int = Field(
    -1,
    description="Visits of each microbatch to each stage: pipelined layers / (stages x num_layers_per_pipeline_stage); -1 -> that value (derived).",
  )
  num_pipeline_microbatches: int = Field(
    -1, description="Microbatches the pipeline splits each batch into; a multiple of the stages; -1 -> stages (x2 with delayed forwarding)."
  )
  pipeline_fsdp_ag_once: bool = Field(False, description="All-gather a stage's FSDP-sharded weights once per step (held gathered), not once per microbatch.")
  pipeline_delay_activation_forwarding: bool = Field(
    False, description="Forward a stage's output one iteration late, so the transfer overlaps the next compute; doubles the bubble, microbatches >= 2 x stages."
  )


DEFAULT_LOGICAL_AXIS_RULES: list[list] = [
  ["activation_batch", ["data", "fsdp", "expert"]],
  ["activation_length", ["sequence", "context"]],
  ["activation_embed", []],
  ["activation_heads", ["tensor"]],
  ["activation_kv_heads", ["tensor"]],
  ["activation_mlp", ["tensor"]],
  ["activation_vocab", ["tensor"]],
  ["activation_exp", ["expert"]],
  ["embed", ["fsdp", "sequence", "context", "expert"]],
  ["q_lora", ["fsdp", "sequence", "context", "expert"]],
  ["kv_lora", ["fsdp", "sequence", "context", "expert"]],
  ["vocab", ["tensor"]],
  ["heads", ["tensor"]],
  ["kv_heads", ["tensor"]],
  ["mlp", ["tensor"]],
  ["exp", ["expert"]],
  ["head_dim", []],
  ["layers", ["stage"]],
  ["layers_outside_pipeline", []],
  ["dense_layers", []],
  ["norm", []],
  ["mhc", []],
  ["cache_batch", ["data", "fsdp", "expert"]],
  ["cache_sequence", []],
  ["cache_heads", ["tensor"]],
  ["cache_kv", []],
  ["cache_layers", []],
]


class LayoutAndSharding(Section):
  logical_axis_rules: list[tuple[str, list[str]]] = Field(
    DEFAULT_LOGICAL_AXIS_RULES, description="Logical axis name -> mesh axes; layers name only logical axes."
  )
  data_sharding: list[str] = Field(["data", "fsdp", "expert"], description="Mesh axes the batch dimension of input data is split over.")
  shard_optimizer_over_data: bool = Field(
    False,
    description="ZeRO-1: split the optimizer state over the 'data' mesh axis too (each data replica keeps its part; the update "
    "gathers the parameters' changes). Changes nothing while the data axis has size 1.",
  )


class DiLoCo(Section):
  enable_diloco: bool = Field(
    False, description="DiLoCo: replica groups (mesh axis 'diloco') train apart and exchange parameter deltas every diloco_sync_period steps."
  )
  diloco_sync_period: int = Field(36, gt=0, description="Inner steps between two synchronisations of the DiLoCo groups.")
  diloco_outer_lr: float = Field(0.3, ge=0, description="Learning rate of the outer Nesterov SGD applied to the groups' mean parameter delta.")
  diloco_outer_momentum: float = Field(0.9, ge=0, lt=1, description="Nesterov momentum of the outer SGD.")


class RematAndOffload(Section):
  remat_policy: Literal[
    "full",
    "minimal",
    "save_dot_except_mlpwi",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "save_out_proj",
    "minimal_offloaded",
    "qkv_proj_offloaded",
    "none",
    "auto",
  ] = Field(
    "full",
    description="What each decoder layer saves for the backward pass (docs/config.md has the table); auto: the least recomputation "
    "whose compiled step fits the device memory with a margin.",
  )
  decoder_layer_input: Literal["auto", "device", "offload"] = Field(
    "auto",
    description="Where each decoder layer's input, saved for the backward pass, is kept: device (HBM), offload (pinned host memory: "
    "copied out in the forward pass, back in the backward pass), auto: device unless the compiled step fits only offloaded (TPU, scan_layers). "
    "Unused with remat_policy=none.",
  )
  optimizer_memory_host_offload: bool = Field(
    False,
    description="Keep the optimizer state in pinned host memory between steps: each step copies it to the device for the update and back, "
    "so the forward and backward passes run without it in device memory.",
  )
  scan_layers: bool = Field(True, description="Stack layers and run them with jax.lax.scan (flat compile time in depth).")


class Optimizer(Section):
  opt_type: Literal["adamw", "sgd", "muon"] = Field("adamw", description="Optimizer.")
  learning_rate: float = Field(3e-5, ge=0, description="Peak learning rate.")
  lr_schedule_type: Literal["cosine", "wsd"] = Field("cosine", description="Schedule after warmup: cosine decay or warmup-stable-decay.")
  warmup_steps_fraction: float = Field(0.1, ge=0, le=1, description="Fraction of schedule steps spent in linear warmup from 0.")
  learning_rate_final_fraction: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
  wsd_decay_steps_fraction: float = Field(0.1, ge=0, le=1, description="wsd: fraction of schedule steps spent decaying.")
  wsd_decay_style: Literal["linear", "cosine"] = Field("linear", description="wsd: shape of the decay.")
  learning_rate_schedule_steps: int = Field(-1, description="Length of the schedule; -1 -> steps.")
  gradient_clipping_threshold: float = Field(1.0, ge=0, description="Clip gradients to this global norm; 0 -> off.")
  gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step (token-weighted).")
  skip_step_on_spikes: bool = Field(False, description="Skip the update when the loss spikes above its recent mean.")
  skip_step_interval: int = Field(128, gt=0, description="Window of recent steps for spike detection.")
  skip_step_scaling_factor: float = Field(6.0, gt=0, description="A loss above mean + factor * std of the window is a spike.")
  sgd_momentum: float = Field(0.0, ge=0, lt=1, description="sgd: momentum (0 -> plain SGD).")
  muon_beta: float = Field(0.95, ge=0, lt=1, description="muon: momentum decay.")


class AdamW(Section):
  adam_b1: float = Field(0.9, ge=0, lt=1, description="Exponential decay of the first moment.")
  adam_b2: float = Field(0.95, ge=0, lt=1, description="Exponential decay of the second moment.")
  adam_eps: float = Field(
    1e-8, gt=0, description="Added to the denominator outside the square root (> 0: a parameter whose gradients are 0 would divide 0 by 0)."
  )
  adam_eps_root: float = Field(0.0, ge=0, description="Added to the second moment inside the square root.")
  adam_weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay (norm scales and biases excluded).")
  adamw_mask: list[str] = Field(
    [], description="Regular expressions; a parameter whose path (e.g. 'layers/mlp/wi_0/kernel') one of them finds gets no weight decay either."
  )
  mu_dtype: Literal["", "float32", "bfloat16"] = Field(
    "", description="adamw, muon and sgd with momentum: storage dtype of the first moment (momentum); '' -> weight_dtype. bfloat16 saves 2 bytes per parameter."
  )


class TrainingLoop(Section):
  steps: int = Field(150_001, gt=0, description="Optimizer steps to train.")
  per_device_batch_size: float = Field(12.0, gt=0, description="Sequences per device per micro-batch.")
  max_target_length: int = Field(2048, gt=0, description="Sequence length of training rows.")
  eval_interval: int = Field(-1, description="Evaluate every this many steps; -1 -> never.")
  eval_steps: int = Field(-1, description="Batches per evaluation; -1 (or 0, as in MaxText) -> the whole eval split.")
  eval_per_device_batch_size: float = Field(
    0.0, ge=0, description="Sequences per device in an eval batch; 0 -> per_device_batch_size. Evaluation keeps no gradients, so it can take more."
  )
  target_eval_loss: float = Field(0.0, ge=0, description="Stop training once eval loss reaches this; 0 -> off.")
  abort_on_nan_loss: bool = Field(True, description="Stop with an error when the loss is NaN (the bad state is not saved).")
  abort_on_inf_loss: bool = Field(True, description="Stop with an error when the loss is infinite (the bad state is not saved).")
  z_loss_multiplier: float = Field(0.0, ge=0, description="Weight of the z-loss (log Z)^2 added to the loss.")
  num_vocab_tiling: int = Field(1, gt=0, description="Compute output logits and loss in this many vocabulary chunks to cut peak memory.")
  profiler: Literal["", "xplane"] = Field("", description="'xplane' writes a JAX trace under the run's tensorboard dir.")
  profiler_steps: int = Field(5, gt=0, description="Steps to trace.")
  skip_first_n_steps_for_profiler: int = Field(1, ge=0, description="Steps to run before tracing starts.")


class DatasetGeneral(Section):
  dataset_type: Literal["synthetic", "grain", "tfds", "hf", "embedded"] = Field(
    "synthetic", description="Input pipeline: synthetic tokens, grain files, TFDS, HF datasets, or the embedded stdlib corpus."
  )
  dataset_path: str = Field("", description="tfds: TFDS data dir holding data prepared in array_record format (never downloaded); empty -> TFDS default.")
  dataset_name: str = Field("c4/en:3.0.1", description="tfds: dataset name[:version].")
  eval_dataset_name: str = Field("", description="tfds: eval dataset name; empty -> dataset_name.")
  train_split: str = Field("train", description="tfds: training split.")
  eval_split: str = Field("validation", description="tfds: eval split.")
  train_data_columns: list[str] = Field(
    ["text"], min_length=1, description="Text column(s) to train on (joined by newlines); SFT: [messages] or [prompt, completion]."
  )
  packing: bool = Field(True, description="Pack several documents into each row (segment ids restart positions).")
  max_segments_per_seq: int = Field(-1, description="Most documents packed in one row; -1 -> no limit.")
  enable_data_shuffling: bool = Field(True, description="Shuffle training records (globally for random-access sources, in a window for streamed ones).")
  data_shuffle_seed: int = Field(0, description="Seed of the data shuffle.")
  num_epoch: int = Field(1, gt=0, description="Passes over the training data.")
  grain_train_files: str = Field("", description="grain: glob (or comma-separated globs) of training files; 'glob,weight;glob,weight' is a weighted mixture.")
  grain_eval_files: str = Field("", description="grain: glob (or comma-separated globs) of eval files.")
  grain_train_mixture_config_path: str = Field(
    "", description='grain: JSON mixture of training files, {"<name>": {"path": "<glob>", "weight": <w>}, ...}; overrides grain_train_files.'
  )
  mixture_exhaustion: Literal["stop", "repeat"] = Field(
    "stop",
    description="Mixtures: 'stop' ends the data once a component has had num_epoch passes; 'repeat' reshuffles and reuses a component "
    "that runs out, until every component has had num_epoch passes.",
  )
  grain_file_type: Literal["arrayrecord", "parquet", "jsonl"] = Field("arrayrecord", description="grain: file format.")
  grain_worker_count: int = Field(
    1, ge=0, description="Data worker processes for random-access sources (ArrayRecord, JSONL, tfds, embedded); 0 -> main process."
  )
  grain_prefetch_buffer_size: int = Field(2, ge=0, description="Batches prefetched per worker (or by a thread when there are no workers); 0 -> none.")
  grain_shuffle_buffer_size: int = Field(1024, gt=0, description="Records in the shuffle window of streamed sources (grain parquet, hf).")
  hf_path: str = Field("", description="hf: dataset builder or path (e.g. json, parquet).")
  hf_train_files: str = Field(
    "", description="hf: glob of local training files (streamed), or 'glob,weight;glob,weight' (a mixture); empty -> the files hf_path names itself."
  )
  hf_eval_files: str = Field("", description="hf: glob of local eval files.")
  use_sft: bool = Field(False, description="Supervised finetuning on conversations (messages or prompt/completion columns).")
  sft_train_on_completion_only: bool = Field(True, description="SFT: train only on assistant tokens.")
  chat_template: str = Field("", description="SFT: Jinja chat template; empty -> the tokenizer's own.")
  chat_template_path: str = Field("", description="SFT: file holding a Jinja chat template.")


class FineTuning(Section):
  use_dpo: bool = Field(
    False, description="Direct preference optimisation on train_data_columns [chosen, rejected] or [prompt, chosen, rejected] (docs/post_training.md)."
  )
  dpo_beta: float = Field(0.1, gt=0, description="DPO: beta, the strength of the implicit KL to the reference model.")
  dpo_label_smoothing: float = Field(0.0, ge=0, le=1, description="DPO: label smoothing eps, the assumed share of flipped preference labels.")
  use_grpo: bool = Field(False, description="GRPO: sample num_generations completions per prompt, score them, update (docs/post_training.md).")


class RL(Section):
  num_generations: int = Field(2, description="GRPO: completions sampled per prompt (a group); at least 2.")
  num_iterations: int = Field(1, gt=0, description="GRPO: optimizer updates per rollout batch, reusing its old log-probabilities.")
  grpo_beta: float = Field(0.08, ge=0, description="GRPO: weight of the KL to the reference model; 0 -> no reference.")
  grpo_epsilon: float = Field(0.2, gt=0, lt=1, description="GRPO: the probability ratio is clipped to [1 - epsilon, 1 + epsilon].")
  grpo_reward_functions: list[str] = Field(
    [], description="GRPO: reward functions 'module:function', each (prompts, completions, **row columns) -> one float per completion."
  )
  grpo_reward_weights: list[FiniteFloat] = Field([], description="GRPO: weight of each reward function in the total reward; [] -> all 1.")
  grpo_reward_timeout_s: float = Field(
    600.0, gt=0, allow_inf_nan=False, description="GRPO: seconds one reward function may take per step before the run stops with an error naming it."
  )
  grpo_reward_memory_gib: float = Field(
    8.0,
    gt=0,
    allow_inf_nan=False,
    description="GRPO: memory (GiB) the reward functions' worker process may allocate; beyond it the run stops naming the function.",
  )


class Tokenizer(Section):
  tokenizer_type: Literal["sentencepiece", "huggingface", "tiktoken"] = Field("sentencepiece", description="Tokenizer library.")
  tokenizer_path: str = Field(
    "", description="sentencepiece .model, HF tokenizer.json or directory, or tiktoken BPE file; empty with dataset_type=embedded -> trained and cached."
  )
  add_bos: bool = Field(True, description="Prepend the BOS token to each document.")
  add_eos: bool = Field(True, description="Append the EOS token to each document.")
  use_truncation: bool = Field(True, description="Truncate each document to max_target_length; false -> split it into chunks.")


class Decoding(Section):
  prompt: str = Field("I love to", description="decode: text to complete (python -m maxtext.decode).")
  max_prefill_predict_length: int = Field(64, gt=0, description="decode: most prompt tokens; prompts are padded to a power-of-two bucket up to it.")
  decode_sampling_strategy: Literal["greedy", "weighted", "topk", "nucleus"] = Field("greedy", description="decode: how the next token is chosen.")
  decode_sampling_temperature: float = Field(1.0, description="decode: logits are divided by it before weighted, topk and nucleus sampling.")
  decode_sampling_top_k: int = Field(0, ge=0, description="decode: topk samples among this many most likely tokens.")
  decode_sampling_nucleus_p: float = Field(-1.0, description="decode: nucleus samples among the most likely tokens whose probability reaches p.")
  decode_sampling_seed: int = Field(0, description="decode: PRNG seed of the sampling strategies.")
  use_chat_template: bool = Field(
    False,
    description="decode: the prompt is one user turn of the chat template (chat_template, chat_template_path or the tokenizer's); stops at its end-of-turn token.",
  )
  hf_model_path: str = Field("", description="decode and eval: a Hugging Face model directory (config.json + safetensors) to load instead of a checkpoint.")
  decode_lora_adapter: str = Field(
    "", description="decode: with lora.max_lora_adapters > 1, the adapter (a lora.lora_adapters name) the prompt runs on ('' = slot 0)."
  )
  eval_harness_tasks: list[str] = Field(
    [], description="eval: lm-evaluation-harness task names maxtext.eval runs on the model instead of the eval loss; [] -> none."
  )
  eval_harness_include_path: str = Field(
    "", description="eval: a directory of harness task YAML files to find eval_harness_tasks in besides the harness's own."
  )
  eval_harness_interval: int = Field(
    -1, description="train: run eval_harness_tasks on the live parameters every this many steps, metrics harness/<task>/<metric>; -1 -> never."
  )


class AOT(Section):
  compile_topology: str = Field("", description="TPU topology to compile for without hardware (e.g. v5p-8); see train_compile.")
  compile_topology_num_slices: int = Field(1, gt=0, description="Slices of compile_topology.")
  compiled_trainstep_file: str = Field("", description="Save (train_compile) or load (train) the compiled train step here.")


class LoRA(Section):
  enable_lora: bool = Field(False, description="Train low-rank adapters; base weights frozen.")
  lora_rank: int = Field(16, gt=0, description="Adapter rank r.")
  lora_alpha: float = Field(32.0, gt=0, description="Adapter scale alpha; the update is (alpha / r) B A x.")
  lora_module_path: str = Field(r".*(attention/(query|key|value|out)|mlp/(wi_0|wi_1|wo))$", description="Regex over parameter module paths that get adapters.")
  lora_restore_path: str = Field("", description="Checkpoint of adapters to start from.")
  max_lora_adapters: int = Field(1, gt=0, description="Adapter slots in the model; > 1: each batch row names its slot (batch key adapter_ids).")
  max_lora_rank: int = Field(0, ge=0, description="Rank of every slot's matrices when max_lora_adapters > 1 (0 = lora_rank); adapters may use less.")
  lora_adapters: list[str] = Field(
    [], description="Slot names with optional ranks, 'name' or 'name:rank', one per slot when max_lora_adapters > 1 ([] = adapter_<i> at lora_rank)."
  )
  adapter_column: str = Field(
    "",
    description="Record column naming each document's adapter (a lora_adapters name or an integer slot); the data then carries per-token adapter_ids.",
  )


class LoRASection(Section):
  lora: LoRA = Field(default_factory=LoRA, description="LoRA settings (set as lora.<key>=value).")


class DerivedValues(Section):
  """Filled by the loader from other keys; setting them directly is an error."""

  emb_dim: int = Field(0, description="base_emb_dim scaled by global_parameter_scale.")
  num_query_heads: int = Field(0, description="base_num_query_heads scaled.")
  num_kv_heads: int = Field(0, description="base_num_kv_heads scaled.")
  mlp_dim: int = Field(0, description="base_mlp_dim scaled.")
  moe_mlp_dim: int = Field(0, description="base_moe_mlp_dim scaled (base_mlp_dim when it is -1).")
  num_decoder_layers: int = Field(0, description="base_num_decoder_layers scaled.")
  num_devices: int = Field(0, description="Devices the run uses (or the AOT topology's).")
  num_slices: int = Field(0, description="Slices the devices form.")
  ici_parallelism: list[int] = Field([], description="ici_* parallelism in mesh_axes order, -1 filled.")
  dcn_parallelism: list[int] = Field([], description="dcn_* parallelism in mesh_axes order, -1 filled.")
  micro_batch_size_to_train_on: int = Field(0, description="Sequences per micro-batch over all devices.")
  global_batch_size_to_train_on: int = Field(0, description="Sequences per optimizer step (micro x gradient_accumulation_steps).")
  global_batch_size_to_eval_on: int = Field(0, description="Sequences per eval batch over all devices (eval_per_device_batch_size, or per_device_batch_size).")
  checkpoint_dir: str = Field("", description="<base_output_directory>/<run_name>/checkpoints/")
  tensorboard_dir: str = Field("", description="<base_output_directory>/<run_name>/tensorboard/")
