#!/usr/bin/env bash
# Issue 41's follow-up GPU run (one device call, under 400 s on an H200): `bash benchmarks/gpu_followup.sh` in the
# project root with `.whl/` carried (the device tool's carry: [".whl"]); writes its report under $OUT (at most 6 files).
#
#   1. quickstart + decode: the decode check that failed on the first run (state on the GPU, CPU mesh), rerun
#   2. throughput rows that the changes since touch: both models by default and with remat_policy=auto, the
#      dropless MoE paths (ragged_dot, tokamax, dense) and mHC n=4; top ops of the 1B rows, mHC and ragged_dot
#   3. decode throughput, layers scanned and unstacked, with the on-device loop's time per step; top ops at batch 1
#   4. time permitting, the batch-1 decode step with XLA:GPU's dynamic-slice fusion on (decode_throughput.py)
#
# `bash benchmarks/gpu_followup.sh --smoke` runs the same commands with the suite's tiny shapes on any host (CPU: no
# wheels installed, XLA's op events switched on for the profiles); OUT defaults to a new temporary directory.
set -u
cd "$(dirname "$0")/.."
SMOKE=()
LIMIT_S=360   # the suite's wall-clock limit: the report is written after every section, so a cut run still leaves one
BUDGET_S=330  # throughput rows that would end past this many seconds of the suite are skipped (gpu_suite --budget_s)
TOTAL_S=390   # section 4 runs only within this many seconds of the script's start
if [ "${1:-}" = "--smoke" ]; then
  SMOKE=(--smoke)
  LIMIT_S=2400  # a loaded 2-core CPU host
  BUDGET_S=2000
  TOTAL_S=4000
fi
OUT="${OUT:-$(mktemp -d /tmp/gpu_followup_XXXXXX)}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/gpu_followup_work_XXXXXX)"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl >"$OUT/pip.log" 2>&1 || echo "pip install failed: see pip.log" >&2
  export PYTHONPATH="$WORK/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
if [ ${#SMOKE[@]} -gt 0 ]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_enable_xprof_traceme=true --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/device.txt" 2>&1 || echo "no nvidia-smi" >"$OUT/device.txt"
start=$SECONDS
timeout "$LIMIT_S" python3 benchmarks/gpu_suite.py ${SMOKE[@]+"${SMOKE[@]}"} --budget_s "$BUDGET_S" --workdir "$WORK/suite" --out "$OUT/followup_report.md" \
  --sections quickstart decode throughput decode_throughput \
  --rows "1B-class, default" "7B slice, default" "MoE, dropless" "MoE, dense" "mHC" "remat_policy=auto" \
  --profile "1B-class" "mHC" "MoE, dropless, ragged_dot" --profile_decode 1 >"$OUT/followup.log" 2>&1
rc=$?
echo "[gpu_followup] suite exit $rc after $((SECONDS - start)) s; report: $OUT/followup_report.md" | tee -a "$OUT/followup.log"
# 4. if time is left: the batch-1 decode step with XLA:GPU's dynamic-slice fusion (a scan's weight slices fed to
# cuBLAS without a copy), in its own process (an XLA build without the flag stops only this one)
left=$((TOTAL_S - SECONDS))
if [ "$left" -gt 30 ]; then
  plan=$([ ${#SMOKE[@]} -gt 0 ] && echo smoke_plan || echo full_plan)
  keys=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_suite; print(' '.join(gpu_suite.$plan().decode_model))")
  flag=$([ ${#SMOKE[@]} -gt 0 ] && echo "" || echo "--xla_gpu_enable_dynamic_slice_fusion=true")
  # shellcheck disable=SC2086 # keys are key=value words
  XLA_FLAGS="${XLA_FLAGS:-} $flag" timeout "$left" python3 benchmarks/decode_throughput.py --batches 1 --steps 20 configs/base.yml $keys \
    run_name=gpu_followup_dsf base_output_directory="$WORK/dsf" >"$OUT/decode_dynamic_slice_fusion.jsonl" 2>>"$OUT/followup.log"
  echo "[gpu_followup] decode with '$flag': exit $? (decode_dynamic_slice_fusion.jsonl)" | tee -a "$OUT/followup.log"
fi
grep -E "^\| .*(FAIL|fail)|Section stopped|Traceback|Error" "$OUT/followup.log" | head -20
exit $rc
