#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md): the Triton kernels bit for bit against the
# torch references, their bandwidth at the paper's bucket sizes, SDP4Bit's compute overhead
# in a GPT 1.3B training step, the GPU tests; then RESULTS/gpu.md and gpu.json (and copies
# in $OUT when it is set, and in benchmarks/ with --write-results).
#
#     bash dev/gpu_check.sh [--rehearse] [--write-results] [--results DIR] [--wheels DIR]
#     bash dev/gpu_check.sh --stamp
#
# Runs as it is on a machine with CUDA torch and triton but no package registry: the wheels
# it needs (megatron-core) come from --wheels [dev/gpu_wheels], filled beforehand by
# `bash dev/gpu_wheels.sh fetch`. Each step runs in its own process under its own time
# budget (`timeout`), all of them inside GPU_CHECK_SECONDS [270] in total, and writes its
# results before the next starts; the report comes last whatever failed. Exit status:
# 0 when every step passed. --rehearse runs every step on this CPU machine (the kernels in
# Triton's interpreter, tiny sizes, a tiny model) with this interpreter's packages. --stamp,
# in the checkout, records its commit in dev/gpu_check_stamp.json for a run from a copy of the
# tree without .git (benchmarks/gpu_check.py, [Note: the commit of a copied tree]).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"
REHEARSE=0
WRITE=()
RESULTS=runs/gpu_check
WHEELS=dev/gpu_wheels
usage="usage: bash dev/gpu_check.sh [--rehearse] [--write-results] [--results DIR] [--wheels DIR] | --stamp"
if [[ "${1:-}" == "--stamp" ]]; then
    (($# == 1)) || { echo "dev/gpu_check.sh: --stamp takes no other argument" >&2; exit 2; }
    exec "$PYTHON" -m benchmarks.gpu_check stamp
fi
while (($#)); do
    case "$1" in
        --rehearse) REHEARSE=1 ;;
        --write-results) WRITE=(--write-results) ;;
        --results) [[ $# -ge 2 ]] || { echo "dev/gpu_check.sh: --results needs a folder" >&2; exit 2; }
                   RESULTS="$2"; shift ;;
        --wheels) [[ $# -ge 2 ]] || { echo "dev/gpu_check.sh: --wheels needs a folder" >&2; exit 2; }
                  WHEELS="$2"; shift ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "dev/gpu_check.sh: unknown argument '$1' ($usage)" >&2; exit 2 ;;
    esac
    shift
done
if ((REHEARSE)) && ((${#WRITE[@]})); then
    echo "dev/gpu_check.sh: --write-results takes a GPU run's figures, not a rehearsal's" >&2
    exit 2
fi
if [[ -n "${GPU_CHECK_SECONDS:-}" && ! "$GPU_CHECK_SECONDS" =~ ^[1-9][0-9]*$ ]]; then
    echo "dev/gpu_check.sh: GPU_CHECK_SECONDS='$GPU_CHECK_SECONDS' is not a whole number of seconds" >&2
    exit 2
fi
mkdir -p "$RESULTS" || exit 2
RESULTS="$(cd "$RESULTS" && pwd)"
rm -f "$RESULTS"/{env,kernels,bandwidth,overhead}.json "$RESULTS"/kernels_*.json \
      "$RESULTS"/gpu.{md,json} "$RESULTS"/steps.tsv "$RESULTS"/gpu_tests.xml \
      "$RESULTS"/{gpu_check,baseline_train}.log "$RESULTS"/baseline_metrics.jsonl
LOG="$RESULTS/gpu_check.log"
export PYTHONUNBUFFERED=1
TOTAL="${GPU_CHECK_SECONDS:-270}"
REPORT_RESERVE=15
T0=$SECONDS
status=0
if ((REHEARSE)); then
    export TRITON_INTERPRET=1
    declare -A BUDGET=([env]=60 [kernels]=120 [bandwidth]=120 [overhead]=180 [gpu_tests]=120)
    TOTAL="${GPU_CHECK_SECONDS:-600}"
    REH=(--rehearse)
else
    unset TRITON_INTERPRET
    # Ceilings: the steps run in order of importance and TOTAL cuts the last ones short.
    # Measured on an H200 (benchmarks/gpu_h200_2026-11-28): install 1 s, env 7, bandwidth 10,
    # overhead 37 (the trainer's start-up, torch.compile of megatron-core's fused bias-GeLU
    # and bias-dropout in the warm-up iterations, then the timed work), kernels 88 with 122
    # tlq_sender cases (32 now). gpu_tests: two 4-rank training runs of about 25 s each.
    declare -A BUDGET=([install]=20 [env]=20 [kernels]=90 [bandwidth]=60 [overhead]=130
                       [gpu_tests]=150)
    REH=()
fi

record() {  # record NAME EXIT SECONDS BUDGET
    printf '%s\t%s\t%s\t%s\n' "$@" >>"$RESULTS/steps.tsv"
    (($2 == 0)) || { status=1; echo "== $1: exit $2" | tee -a "$LOG"; }
}

# step NAME COMMAND...: run under min(its budget, what is left of TOTAL), log, record.
step() {
    local name="$1" budget="${BUDGET[$1]}" left start rc ms
    shift
    left=$((TOTAL - REPORT_RESERVE - (SECONDS - T0)))
    ((left < budget)) && budget=$left
    if ((budget <= 0)); then
        echo "== $name: skipped, no time left" | tee -a "$LOG"
        record "$name" 124 0 0
        return
    fi
    echo "== $name (budget ${budget} s)" | tee -a "$LOG"
    start=$(date +%s%N)
    timeout --kill-after=10 "$budget" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    ms=$((($(date +%s%N) - start) / 1000000))
    record "$name" "$rc" "$((ms / 1000)).$((ms % 1000 / 100))" "$budget"
}

# The wheels go in with --target + PYTHONPATH rather than into a venv: the image's python3 is
# itself a venv, and a venv made from it with --system-site-packages would not see its torch
# and triton.
SITE="${GPU_CHECK_SITE:-/tmp/sdp4bit_gpu_site}"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
WHEEL_FILES=("$WHEELS"/*.whl)
shopt -u nullglob
if ((REHEARSE)); then
    echo "== install: rehearsal, this interpreter's own packages" | tee -a "$LOG"
    record install 0 0 0
elif ((${#WHEEL_FILES[@]})); then
    step install "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "${WHEEL_FILES[@]}"
elif "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    echo "== install: no wheels in $WHEELS, megatron-core is installed" | tee -a "$LOG"
    record install 0 0 0
else
    echo "== install: no wheels in $WHEELS and megatron-core is not installed: fill the" \
         "folder with 'bash dev/gpu_wheels.sh fetch' on a machine with the package registry" \
        | tee -a "$LOG"
    record install 1 0 0
fi
step env "$PYTHON" -m benchmarks.gpu_check env --results "$RESULTS" --wheels "$WHEELS" "${REH[@]}"
step kernels "$PYTHON" -m benchmarks.gpu_check kernels --results "$RESULTS" "${REH[@]}"
step bandwidth "$PYTHON" -m benchmarks.gpu_check bandwidth --results "$RESULTS" "${REH[@]}"
step overhead "$PYTHON" -m benchmarks.gpu_check overhead --results "$RESULTS" "${REH[@]}"
# The rest of tests/gpu (test_kernels_cuda.py runs the kernels step's checks again); without
# CUDA pytest reports it skipped.
step gpu_tests "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu/test_training_cuda.py \
    --junitxml "$RESULTS/gpu_tests.xml"
echo "== report" | tee -a "$LOG"
timeout --kill-after=5 "$REPORT_RESERVE" "$PYTHON" -m benchmarks.gpu_check report \
    --results "$RESULTS" "${WRITE[@]}" "${REH[@]}" 2>&1 | tee -a "$LOG"
((PIPESTATUS[0] == 0)) || status=1
# The report last, so that the end of the output (all a remote call may show) holds it.
cat "$RESULTS/gpu.md" 2>/dev/null
echo "== done in $((SECONDS - T0)) s, exit $status: $RESULTS/gpu.md" | tee -a "$LOG"
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then cp "$LOG" "$OUT/"; fi
exit $status
