#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one command: the Triton kernels against the torch
# references on the GPU, a one-GPU training run with every SDP4Bit flag, and the kernel
# benchmark (which adds a GPU section to benchmarks/quantization.{md,json}).
#
# Needs an environment with CUDA torch, triton and megatron-core importable (and this
# repository on PYTHONPATH or installed). Output goes to OUT_DIR [runs/gpu_check].
#     bash tools/gpu_check.sh [--skip-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-runs/gpu_check}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT_DIR/gpu.txt"

echo "== GPU tests"
python -m pytest -q -m gpu tests/gpu 2>&1 | tee "$OUT_DIR/gpu_tests.log" || status=1

if [[ "${1:-}" != "--skip-bench" ]]; then
    echo "== kernel benchmark"
    python -m benchmarks.quantization --write-results 2>&1 | tee "$OUT_DIR/bench.log" || status=1
fi
exit $status
