#!/usr/bin/env bash
# The simulated two-node cluster benchmark in one command from a fresh clone: sets up .venv
# (as the quickstart does), then runs `python -m dev.simcluster` with the arguments given. Needs root
# (network namespaces): sudo bash benchmarks/simcluster.sh [rates...] [--write-results] [...]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh
exec python -m dev.simcluster "$@"
