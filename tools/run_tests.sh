#!/usr/bin/env bash
# The README's test command (CI's .ci/run calls it verbatim). Two passes:
#   1. the whole suite in .venv, with the megatron-core that requirements.txt picks for this
#      Python (0.16.1 on Python 3.11);
#   2. the megatron-core integration and end-to-end tests (tests/distributed/test_integration_*.py
#      but the spawn helper's, tests/e2e but those marked release_independent) again in
#      .venv-mcore019, against megatron-core 0.19.2, the release for
#      Python >= 3.12. 0.19.2 declares Python >= 3.12 but its cp311 wheel runs on 3.11, so it
#      is installed there with --ignore-requires-python: a test-only environment.
# Both environments are created on first use. Usage:
#   bash tools/run_tests.sh [pytest arguments]
# Test paths among the arguments select what runs: pass 1 runs them, pass 2 those of them that
# are integration or end-to-end tests. SDP4BIT_SKIP_MCORE019=1 skips pass 2.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"

# megatron-core of Python >= 3.12, as requirements.txt pins it
MCORE_NEW="$(sed -n 's/^megatron-core==\([0-9][0-9.]*\) *; *python_version *>= *"3\.12".*/\1/p' \
    requirements.txt)"
[ -n "$MCORE_NEW" ] || { echo "run_tests.sh: no 'megatron-core==X; python_version >= \"3.12\"'" \
    "line in requirements.txt" >&2; exit 2; }
# The second pass: what touches megatron-core (not the spawn helper's own test).
SPAWN_TEST=tests/distributed/test_integration_spawn.py
SECOND_PASS=()
for f in tests/distributed/test_integration_*.py tests/e2e; do
    [ "$f" = "$SPAWN_TEST" ] || SECOND_PASS+=("$f")
done

# Split the arguments into test paths and pytest options.
paths=() options=()
for arg in "$@"; do
    if [ -e "${arg%%::*}" ] && [[ "$arg" != -* ]]; then paths+=("$arg"); else options+=("$arg"); fi
done
if [ ${#paths[@]} -eq 0 ]; then
    first=(tests) second=("${SECOND_PASS[@]}")
else
    first=("${paths[@]}") second=()
    for p in "${paths[@]}"; do
        case "${p%%::*}" in
            "$SPAWN_TEST") ;;
            tests/distributed/test_integration_*|tests/e2e|tests/e2e/*) second+=("$p") ;;
        esac
    done
fi
# Per-file progress (pytest's default verbosity), failure reasons and the slowest tests.
PYTEST=(python -m pytest -ra --durations=15)

set +e  # run both passes; each pass stops at its own first setup error
(
    set -e
    source tools/setup_env.sh
    version="$(python -c 'from megatron.core import package_info as p; print(p.__version__)' \
        2>/dev/null)"
    echo "== pass 1: ${first[*]} with megatron-core ${version%%+*} (.venv)"
    "${PYTEST[@]}" "${options[@]}" "${first[@]}"
)
status1=$? status2=skipped
if [ "${SDP4BIT_SKIP_MCORE019:-0}" = 1 ]; then
    echo "== pass 2 (megatron-core $MCORE_NEW) skipped: SDP4BIT_SKIP_MCORE019=1"
elif [ ${#second[@]} -eq 0 ]; then
    echo "== pass 2 (megatron-core $MCORE_NEW) skipped: no integration or end-to-end test selected"
else
    (
        set -e
        export SDP4BIT_VENV=.venv-mcore019 SDP4BIT_MEGATRON_CORE="$MCORE_NEW"
        source tools/setup_env.sh
        echo "== pass 2: ${second[*]} with megatron-core $MCORE_NEW (.venv-mcore019, test-only)"
        # The tests check that this is the megatron-core they run against.
        # Tests marked release_independent (SDP4Bit's own checks) are deselected here.
        SDP4BIT_EXPECT_MEGATRON_CORE="$MCORE_NEW" SDP4BIT_RELEASE_PASS=1 \
            "${PYTEST[@]}" "${options[@]}" "${second[@]}"
    )
    status2=$?
fi
set -e

echo "== exit status: pass 1 $status1, pass 2 (megatron-core $MCORE_NEW) $status2"
[ "$status1" = 0 ] || exit "$status1"
[ "$status2" = 0 ] || [ "$status2" = skipped ] || exit "$status2"
