#!/usr/bin/env bash
#SBATCH --job-name=sdp4bit-acc-350M-quantGradwithoutHT
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --signal=TERM@180
# Your cluster's partition and account, if it needs them: delete one '#' and fill in.
##SBATCH --partition=
##SBATCH --account=
# Submit from the repository root, with the Python environment active (e.g. source
# .venv/bin/activate): sbatch copies the submitting shell's environment into the job
# (its default --export=ALL) and srun passes it on to every node. The job's output goes to
# logs/<job name>-<job id>.out in the repository (the folder must exist: SLURM does not
# create it, and a job whose output file cannot be opened fails without a word).
# 24 h, a common limit: 80,000 iterations can need more than one job. Submitting the script
# again continues from the last checkpoint: saved every 5000 iterations, and on SIGTERM, which
# SLURM sends 3 minutes before --time (--signal=TERM@180 above) and on preemption: the run
# finishes its iteration, saves it and exits (--exit-signal-handler; common.sh says how).
# EXTRA_ARGS="--exit-duration-in-mins 1380" saves and stops an hour before the limit instead.
# Paper Table 1, GPT-350M, TLq: two-level gradient all-to-all, 8-bit intra-node / 4-bit inter-node.
#   sbatch [--nodes N] sample_scripts/accuracy/350M/quantGradwithoutHT/train.sh
#   or on every node, without SLURM: NNODES=.. MASTER_ADDR=.. bash sample_scripts/accuracy/350M/quantGradwithoutHT/train.sh
# Data, nodes, GPUs, output: environment variables documented in sample_scripts/common.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
[[ -f "$here/pretrain_gpt.py" ]] || here="${SLURM_SUBMIT_DIR:-$PWD}"  # sbatch runs a spooled copy
export SDP4BIT_HOME="${SDP4BIT_HOME:-$here}"
source "$SDP4BIT_HOME/sample_scripts/common.sh"

accuracy_args 350M quantGradwithoutHT
sdp4bit_launch "$SDP4BIT_HOME/pretrain_gpt.py" "${ARGS[@]}"
