#!/usr/bin/env bash
# Submit the speed runs of the paper's Table 2 for several node counts, one job each.
#   bash sample_scripts/speed/sweep.sh                     # NODE_COUNTS="4 8 16", every model and method
#   NODE_COUNTS="16" MODELS="1.3B 2.7B" METHODS=sdp4bit bash sample_scripts/speed/sweep.sh
# Extra sbatch options (partition, account, --gpus-per-node 8 with CLUSTER=h800): SBATCH_ARGS.
# Every job runs sample_scripts/speed/<model>/<method>.sbatch, hence pretrain_gpt.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/../.."  # jobs are submitted from the repository root (SLURM_SUBMIT_DIR)
mkdir -p logs     # each job's --output=logs/%x-%j.out: SLURM does not create the folder
for nodes in ${NODE_COUNTS:-4 8 16}; do
    for model in ${MODELS:-1.3B 2.7B 6.7B 13B 18B}; do
        for method in ${METHODS:-baseline sdp4bit}; do
            script="sample_scripts/speed/$model/$method.sbatch"
            [[ -f "$script" ]] || { echo "no script $script" >&2; exit 2; }
            # shellcheck disable=SC2086  # SBATCH_ARGS is meant to be word-split
            sbatch --nodes "$nodes" ${SBATCH_ARGS:-} "$script"
        done
    done
done
