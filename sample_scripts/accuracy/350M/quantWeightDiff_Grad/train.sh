#!/usr/bin/env bash
#SBATCH --job-name=sdp4bit-acc-350M-quantWeightDiff_Grad
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --exclusive
# Paper Table 1, GPT-350M, SDP4Bit: qWD + TLq-HS.
#   sbatch [--nodes N] sample_scripts/accuracy/350M/quantWeightDiff_Grad/train.sh
#   or on every node, without SLURM: NNODES=.. MASTER_ADDR=.. bash sample_scripts/accuracy/350M/quantWeightDiff_Grad/train.sh
# Data, nodes, GPUs, output: environment variables documented in sample_scripts/common.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
[[ -f "$here/pretrain_gpt.py" ]] || here="${SLURM_SUBMIT_DIR:-$PWD}"  # sbatch runs a spooled copy
export SDP4BIT_HOME="${SDP4BIT_HOME:-$here}"
source "$SDP4BIT_HOME/sample_scripts/common.sh"

accuracy_args 350M quantWeightDiff_Grad
sdp4bit_launch "$SDP4BIT_HOME/pretrain_gpt.py" "${ARGS[@]}"
