#!/usr/bin/env bash
# Set up a fresh virtual environment (.venv) with the pinned packages and run the test suite.
# Usage: bash tools/run_tests.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
exec python -m pytest -ra -q "$@" tests
