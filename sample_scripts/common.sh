# Shared by every script under sample_scripts/ (sourced, never run). The scripts differ only
# in the model and the method; this file holds the paper's model cards, schedules and
# method flags once, and the launcher. Each script ends with its own
#     sdp4bit_launch "$SDP4BIT_HOME/pretrain_gpt.py" "${ARGS[@]}"
#
# The Python environment with torch and this project must be active in the shell that runs
# sbatch (e.g. source .venv/bin/activate): sbatch copies that shell's environment into the
# job (its default --export=ALL; not with --export=NONE or SBATCH_EXPORT=NONE) and srun passes
# it on to every node, so torchrun and python resolve there as they did at submission.
# sdp4bit_launch stops with a message when torchrun is not on PATH.
#
# Every batch script's header sets --time, --output=logs/%x-%j.out (relative to the submit
# directory, the repository root; logs/ is part of the repository, and SLURM does not create
# a missing folder) and, commented out, --partition and --account for clusters that need them.
#
# Environment (all optional; defaults in brackets):
#   SDP4BIT_HOME    repository root [the directory above sample_scripts/; when sbatch runs a
#                   spooled copy of a script: $SLURM_SUBMIT_DIR, so submit from the root]
#   DATA_PATH       preprocessed Pile prefix, or weighted 'W1 P1 W2 P2'
#                   [$SDP4BIT_HOME/data/pile/pile_text_document]
#   VOCAB_FILE      GPT-2 vocab.json  [$SDP4BIT_HOME/data/gpt2/vocab.json]
#   MERGE_FILE      GPT-2 merges.txt  [$SDP4BIT_HOME/data/gpt2/merges.txt]
#   CLUSTER         a100 | h800: the paper's two clusters; picks TP/PP of 13B/18B and the
#                   default GPUS_PER_NODE [a100]
#   NNODES          nodes [$SLURM_JOB_NUM_NODES, else 1]
#   GPUS_PER_NODE   processes per node [$SLURM_GPUS_ON_NODE, else 4 (a100) or 8 (h800)]
#   MASTER_ADDR     rendezvous host [first node of $SLURM_JOB_NODELIST, else localhost]
#   MASTER_PORT     rendezvous port [29500]
#   LAUNCHER        srun | torchrun: srun starts one torchrun per node [srun inside a SLURM
#                   job, torchrun otherwise; without SLURM run the script on every node]
#   RUN_ROOT        checkpoints, TensorBoard, metrics go to $RUN_ROOT/<kind>/<model>/<method>
#                   [$SDP4BIT_HOME/runs]
#   TRAIN_ITERS     iterations [80000 accuracy, 30 speed]
#   MICRO_BATCH_SIZE  [the model card's]
#   WANDB_PROJECT   W&B project; empty = no W&B [empty]
#   SHUTDOWN_TIMEOUT  seconds torchrun waits for its workers after a signal before SIGKILL:
#                   the time to finish an iteration and save a checkpoint [120]
#   EXTRA_ARGS      more pretrain_gpt.py flags, appended last (word-split) [empty]

if [[ -z "${SDP4BIT_HOME:-}" || ! -f "$SDP4BIT_HOME/pretrain_gpt.py" ]]; then
    echo "sample_scripts: cannot find pretrain_gpt.py in '${SDP4BIT_HOME:-}': set SDP4BIT_HOME" \
         "to the repository root (or submit from it)" >&2
    exit 2
fi

CLUSTER="${CLUSTER:-a100}"
case "$CLUSTER" in
    a100) _cluster_gpus=4 ;;  # 4 x A100-40GB per node, Slingshot-10
    h800) _cluster_gpus=8 ;;  # 8 x H800 per node, InfiniBand
    *) echo "CLUSTER=$CLUSTER: use a100 or h800" >&2; exit 2 ;;
esac
NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$_cluster_gpus}}"
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        # read every name: `| head -n 1` would kill scontrol with SIGPIPE under pipefail
        mapfile -t _hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        MASTER_ADDR="${_hosts[0]:?scontrol show hostnames gave no host}"
    else
        MASTER_ADDR=localhost
    fi
fi
MASTER_PORT="${MASTER_PORT:-29500}"
DATA_PATH="${DATA_PATH:-$SDP4BIT_HOME/data/pile/pile_text_document}"
VOCAB_FILE="${VOCAB_FILE:-$SDP4BIT_HOME/data/gpt2/vocab.json}"
MERGE_FILE="${MERGE_FILE:-$SDP4BIT_HOME/data/gpt2/merges.txt}"
RUN_ROOT="${RUN_ROOT:-$SDP4BIT_HOME/runs}"
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))

# model_card NAME: sets LAYERS HIDDEN HEADS and, for the accuracy runs, LR MICRO_BATCH.
model_card() {
    case "$1" in
        125M) LAYERS=12 HIDDEN=768  HEADS=12 LR=6e-4   MICRO_BATCH=8 ;;
        350M) LAYERS=24 HIDDEN=1024 HEADS=16 LR=3e-4   MICRO_BATCH=8 ;;
        1.3B) LAYERS=24 HIDDEN=2048 HEADS=16 LR=2e-4   MICRO_BATCH=2 ;;
        2.7B) LAYERS=32 HIDDEN=2560 HEADS=32 LR=1.6e-4 MICRO_BATCH=1 ;;
        6.7B) LAYERS=32 HIDDEN=4096 HEADS=32 LR=1.2e-4 MICRO_BATCH=2 ;;
        13B)  LAYERS=40 HIDDEN=5120 HEADS=40 LR=1e-4   MICRO_BATCH=1 ;;
        18B)  LAYERS=40 HIDDEN=6144 HEADS=48 LR=1e-4   MICRO_BATCH=1 ;;
        *) echo "unknown model '$1'" >&2; exit 2 ;;
    esac
    MICRO_BATCH="${MICRO_BATCH_SIZE:-$MICRO_BATCH}"
}

# method_args METHOD: the SDP4Bit flags of one column of the paper's Table 1 -> METHOD_ARGS.
# Every method runs Megatron's distributed optimizer (the paper's baseline does too).
# Gradient groups are 128 on both hops, as in every released script.
method_args() {
    local qwd=(--quantized-weights --weight-quantization-bits 4 --wq-group-size 2048)
    local tlq=(--quantized-gradients
               --gradient-quantization-bits-intra 8 --gq-group-size-intra 128
               --gradient-quantization-bits-inter 4 --gq-group-size-inter 128)
    case "$1" in
        baseline)             METHOD_ARGS=() ;;                             # bf16 / fp32
        quantWeightDiff)      METHOD_ARGS=("${qwd[@]}") ;;                  # qWD
        quantGradwithoutHT)   METHOD_ARGS=("${tlq[@]}") ;;                  # TLq
        quantGrad)            METHOD_ARGS=("${tlq[@]}" --hadamard-transform) ;;  # TLq-HS
        quantWeightDiff_Grad|sdp4bit)                                       # SDP4Bit
                              METHOD_ARGS=("${qwd[@]}" "${tlq[@]}" --hadamard-transform) ;;
        *) echo "unknown method '$1'" >&2; exit 2 ;;
    esac
}

# Flags every run shares: optimizer and schedule of the paper, bf16, distributed optimizer,
# and a clean stop on SIGTERM (--exit-signal-handler: every rank finishes its iteration, one
# checkpoint is saved there when the run has --save, every rank exits 0).
#
# Preemption and time limits. Each batch script asks SLURM for SIGTERM 3 minutes before its
# --time (#SBATCH --signal=TERM@180; SLURM may send it up to a minute earlier). Without 'B:'
# SLURM signals the job step, i.e. the torchrun that srun started on every node (and, with
# proctrack/cgroup, its workers too: a second SIGTERM changes nothing), not the batch shell,
# which would only run a trap after srun returned. torchrun passes SIGTERM to its workers and
# waits SHUTDOWN_TIMEOUT seconds (torchrun's own default is 30) before SIGKILL: 120 s covers
# an iteration and the save of these models; 180 s of warning leave a minute for the rest. A
# preemption or the limit itself sends SIGTERM too, with only KillWait (often 30 s) before
# SIGKILL. torchrun exits 1 after any signal (it reports the signal, whatever its workers
# did), so such a job ends FAILED, TIMEOUT or PREEMPTED with a complete checkpoint:
# submitting the script again continues from it. With LAUNCHER=torchrun inside a job (no srun)
# the early signal does not reach torchrun. docs/reliability.md: Preemption.
_common_args() {
    local lr="$1" min_lr
    min_lr="$(awk -v x="$lr" 'BEGIN { printf "%g", x / 10 }')"  # cosine decay to lr/10
    ARGS=(
        --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
        --seq-length 2048 --max-position-embeddings 2048
        --lr "$lr" --min-lr "$min_lr" --lr-decay-style cosine --lr-decay-iters 70000
        --lr-warmup-fraction 0.01
        --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.1 --clip-grad 1.0
        --bf16 --use-distributed-optimizer
        --recompute-activations --recompute-granularity selective
        --exit-signal-handler
    )
    if [[ -n "${WANDB_PROJECT:-}" ]]; then
        ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "$RUN_NAME"
               --wandb-save-dir "$RUN_DIR/wandb")
    fi
}

# accuracy_args MODEL METHOD -> ARGS: Table 1 runs (Pile, 80k iterations, global batch 256).
accuracy_args() {
    model_card "$1"
    method_args "$2"
    RUN_NAME="accuracy-$1-$2"
    RUN_DIR="$RUN_ROOT/accuracy/$1/$2"
    _common_args "$LR"
    ARGS+=(
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
        --micro-batch-size "$MICRO_BATCH" --global-batch-size 256
        --train-iters "${TRAIN_ITERS:-80000}"
        --data-path $DATA_PATH --split 969,30,1
        --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
        --log-interval 100 --eval-interval 100 --eval-iters 10
        --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 5000
        --tensorboard-dir "$RUN_DIR/tensorboard" --log-validation-ppl-to-tensorboard
        --metrics-jsonl "$RUN_DIR/metrics.jsonl"
    )
    case "$1" in 1.3B|6.7B) ARGS+=(--overlap-grad-reduce) ;; esac  # as the released scripts
    ARGS+=("${METHOD_ARGS[@]}")
    # shellcheck disable=SC2206  # EXTRA_ARGS is meant to be word-split
    ARGS+=(${EXTRA_ARGS:-})
}

# speed_args MODEL METHOD -> ARGS: Table 2 runs (mock data, so no data files are needed;
# micro batch 1, no accumulation; 30 iterations: the paper reports the mean of the 10 after
# 20 warm-up iterations).
speed_args() {
    model_card "$1"
    method_args "$2"
    local tp=1 pp=1
    case "$1:$CLUSTER" in
        6.7B:*)              tp=4 ;;
        13B:a100|18B:a100)   tp=4 pp=2 ;;
        13B:h800|18B:h800)   tp=8 ;;
    esac
    if (( WORLD_SIZE % (tp * pp) )); then
        echo "$1 needs TP x PP = $((tp * pp)) to divide $WORLD_SIZE GPUs" >&2; exit 2
    fi
    local micro=1 dp=$((WORLD_SIZE / (tp * pp)))
    RUN_NAME="speed-$1-$2-${NNODES}n-$CLUSTER"
    RUN_DIR="$RUN_ROOT/speed/$1/$2/${NNODES}nodes"
    _common_args "$LR"
    ARGS+=(
        --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp"
        --micro-batch-size "$micro" --global-batch-size "$((micro * dp))"
        --train-iters "${TRAIN_ITERS:-30}" --mock-data
        # GPT-2's vocabulary size without its files: the same padded embedding (50,304 rows)
        --tokenizer-type NullTokenizer --vocab-size 50257
        --log-interval 1 --eval-interval 1000000 --eval-iters 0
        --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-jsonl "$RUN_DIR/metrics.jsonl"
        # Transformer Engine's layers, as Megatron-LM's GPU runs use them (pip install -e
        # ".[te]"); without it: EXTRA_ARGS="--transformer-impl local"
        --transformer-impl transformer_engine
    )
    if [[ "$2" != baseline ]]; then
        ARGS+=("${METHOD_ARGS[@]}")
        case "$1" in 1.3B|2.7B|6.7B) ARGS+=(--gradient-alltoall-pipeline 8) ;; esac
    fi
    # shellcheck disable=SC2206
    ARGS+=(${EXTRA_ARGS:-})
}

# sdp4bit_launch PROGRAM ARGS...: one torchrun per node, c10d rendezvous at MASTER_ADDR.
sdp4bit_launch() {
    local launcher="${LAUNCHER:-}"
    [[ -n "$launcher" ]] || { [[ -n "${SLURM_JOB_ID:-}" ]] && launcher=srun || launcher=torchrun; }
    local torchrun_args=(
        --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE"
        --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
        --rdzv-id "${SLURM_JOB_ID:-sdp4bit-$RUN_NAME}"
        --shutdown-timeout "${SHUTDOWN_TIMEOUT:-120}"
    )
    if ! command -v torchrun >/dev/null 2>&1; then
        echo "sample_scripts: torchrun is not on PATH: activate the Python environment" \
             "(e.g. source .venv/bin/activate) before sbatch or bash; a job runs with the" \
             "environment of the shell that submitted it" >&2
        exit 2
    fi
    mkdir -p "$RUN_DIR"
    echo "[sample_scripts] $RUN_NAME: $NNODES node(s) x $GPUS_PER_NODE GPU(s), logs in $RUN_DIR" >&2
    case "$launcher" in
        srun) srun --nodes "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 \
                   torchrun "${torchrun_args[@]}" "$@" ;;
        torchrun) torchrun "${torchrun_args[@]}" "$@" ;;
        *) echo "LAUNCHER=$launcher: use srun or torchrun" >&2; exit 2 ;;
    esac
}
