#!/usr/bin/env bash
# The GPU checks in one command, prepared before a GPU is lent.
#
#   bash bench/gpu_check.sh           # on a CUDA machine: within 8 minutes
#   bash bench/gpu_check.sh --smoke   # on the CPU: every stage end to end, tiny shapes,
#                                     # results under a temporary folder (nothing in the repo)
#   bash bench/gpu_check.sh --stages engine   # some stages only (comma list), e.g. to rerun
#                                             # one that failed without redoing the others
#
# Stages (each under its own time limit, so one stuck stage cannot eat the others' time):
#   1. bench/kernels_gpu.py     kernel correctness and timings -> bench/results/kernels_gpu_<GPU>.json
#   2. bench/tune_kernels.py    fused/separate thresholds      -> loraplane_kernels/tuning/<GPU>.json
#   3. bench/multi_lora.py      engine benches on the real model (SmolLM2-135M) on the GPU
#                                                              -> bench/results/multi_lora_gpu.json
# Exit status: non-zero if any stage failed; the others still ran.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

ALL_STAGES=kernels,tuning,engine
listed() { [[ ",$2," == *",$1,"* ]]; }  # listed NAME COMMA_LIST

SMOKE=0
STAGES=$ALL_STAGES
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --stages) STAGES=${2:?--stages needs a comma list of $ALL_STAGES}; shift ;;
    *) echo "gpu_check: unknown argument $1 (--smoke, --stages LIST)" >&2; exit 2 ;;
  esac
  shift
done
for s in ${STAGES//,/ }; do
  listed "$s" "$ALL_STAGES" || {
    echo "gpu_check: unknown stage $s ($ALL_STAGES)" >&2; exit 2; }
done

if [ "$SMOKE" = 1 ]; then
  OUT=${GPU_CHECK_OUT:-$(mktemp -d)}
  TUNING="$OUT/tuning.json"
  export TRITON_INTERPRET=1
  KERNELS=(--smoke --out "$OUT")
  TUNE=(--smoke --out "$TUNING")
  ENGINE=(--smoke --models random --device cpu --sections mixed,tenant
          --out "$OUT/multi_lora_smoke.json")
  LIMITS=(240 240 400)
else
  OUT=bench/results
  TUNING=""
  KERNELS=(--out "$OUT")
  TUNE=(--quick)
  ENGINE=(--models smollm2 --device cuda --sections mixed,latency,tenant --requests 32
          --tenant-requests 64 --repeats 1
          --out "$OUT/multi_lora_gpu.json")
  LIMITS=(150 150 160)
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible (use --smoke on a CPU)" >&2
    exit 2
  fi
fi
mkdir -p "$OUT"
failed=0
stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  listed "$name" "$STAGES" || return 0
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  if timeout "$limit" "$@"; then
    echo "== $name ok in $((SECONDS - t0))s"
  else
    echo "== $name FAILED (status $?) after $((SECONDS - t0))s"
    failed=1
  fi
}
stage kernels "${LIMITS[0]}" "$PY" bench/kernels_gpu.py "${KERNELS[@]}"
stage tuning "${LIMITS[1]}" "$PY" bench/tune_kernels.py "${TUNE[@]}"
[ -n "$TUNING" ] && [ -f "$TUNING" ] && export LORAPLANE_KERNELS_TUNING="$TUNING"
stage engine "${LIMITS[2]}" "$PY" bench/multi_lora.py "${ENGINE[@]}"
echo "gpu_check: results in $OUT"
exit $failed
