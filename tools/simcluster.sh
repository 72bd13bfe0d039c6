#!/usr/bin/env bash
# The simulated two-node cluster benchmark in one command from a fresh clone: sets up .venv
# (as the quickstart does), then runs tools/simcluster with the arguments given. Needs root
# (network namespaces): sudo bash tools/simcluster.sh [rates...] [--write-results] [...]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh
exec python tools/simcluster "$@"
