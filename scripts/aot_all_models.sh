#!/usr/bin/env bash
# AOT-compile the train step of every configs/models/*.yml for a TPU topology it fits, with 2 slices
# (dcn data parallelism), on this host (CPU only; needs libtpu). Prints one Markdown table row per model.
# Too slow for CI (minutes per model on 2 cores); tests/test_aot.py checks a representative subset.
#   scripts/aot_all_models.sh [extra key=value ...]      e.g. max_target_length=4096
set -uo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cpu

topology_for() {  # a slice type with enough HBM for parameters + AdamW state at per_device_batch_size=1
  case "$1" in
    qwen3-0.6b | qwen3-1.7b | gemma2-2b) echo v5e-16 ;;
    qwen3-4b | qwen3-8b | llama2-7b | llama3-8b | llama3.1-8b | mistral-7b | gemma2-9b) echo v5p-32 ;;
    llama2-13b | qwen3-14b | gemma2-27b | qwen3-32b) echo v5p-64 ;;
    llama2-70b | llama3.1-70b | mixtral-8x7b) echo v5p-128 ;;
    llama3.1-405b) echo v5p-512 ;;
    deepseek3-tiny) echo v5e-16 ;;
    qwen3-30b-a3b) echo v5p-64 ;;
    qwen3-235b-a22b) echo v5p-128 ;;
    deepseek3-671b) echo v5p-1024 ;;
    *) echo v5p-128 ;;
  esac
}

extra_for() {  # expert parallelism with capacity for the large MoE models (docs/tpu.md)
  case "$1" in
    qwen3-235b-a22b | deepseek3-671b) echo "ici_expert_parallelism=8 capacity_factor=1.25" ;;
    *) echo "" ;;
  esac
}

echo "| model | topology x slices | layer inputs | compile s | args GiB | temp GiB | total GiB | HBM GiB | fits | TFLOPs/step |"
echo "|---|---|---|---|---|---|---|---|---|---|"
status=0
for file in configs/models/*.yml; do
  model=$(basename "$file" .yml)
  topo=$(topology_for "$model")
  out=$(python -m maxtext.train_compile configs/base.yml "model_name=$model" "compile_topology=$topo" compile_topology_num_slices=2 \
    per_device_batch_size=1 max_target_length=2048 $(extra_for "$model") "$@" 2>/tmp/aot_"$model".err)
  rc=$?
  json=$(printf '%s\n' "$out" | tail -n 1)
  if [[ $rc -ne 0 && $rc -ne 3 ]]; then
    echo "| $model | $topo x 2 | | error (exit $rc): $(tail -n 1 /tmp/aot_"$model".err) | | | | | | |"
    status=1
    continue
  fi
  [[ $rc -eq 3 ]] && status=1
  python - "$model" "$topo" "$json" <<'PY'
import json, sys
model, topo, r = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
g = lambda k: f"{r[k] / 2**30:.1f}"
print(f"| {model} | {topo} x 2 | {r['decoder_layer_input']} | {r['compile_seconds']:.0f} | {g('argument_bytes')} | {g('temp_bytes')} | {g('total_bytes')} | {g('hbm_bytes')} | {'yes' if r['fits'] else 'NO'} | {r['tflops_per_step']:.0f} |")
PY
done
exit $status
