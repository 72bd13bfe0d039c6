#!/usr/bin/env bash
# The README's test command (CI's .ci/run calls it verbatim). Two passes:
#   1. the whole suite in .venv, with the megatron-core that requirements.txt picks for this
#      Python (0.16.1 on Python 3.11);
#   2. the megatron-core integration and end-to-end tests (tests/distributed/test_integration_*.py
#      but the spawn helper's, and tests/e2e) again in .venv-mcore019, against megatron-core
#      0.19.2, the release for Python >= 3.12. 0.19.2 declares Python >= 3.12 but its cp311
#      wheel runs on 3.11, so it is installed there with --ignore-requires-python: a test-only
#      environment, which holds megatron-core and this project and reads every other package
#      from .venv.
# Tests marked release_independent run once (tests/conftest.py, SDP4BIT_TEST_PASS): the
# end-to-end ones in pass 2, the others in pass 1, so that the passes end at about the same
# time; those marked main_environment (the README's commands) in pass 1 only.
# Both environments are created on first use. The passes run at the same time: pass 1 starts
# with the unit tests (one core each, mostly), while pass 2 creates its environment and runs
# its multi-process tests on the other core; pass 2's output is printed when both are done.
# SDP4BIT_SEQUENTIAL=1 runs them one after the other. Usage:
#   bash dev/run_tests.sh [pytest arguments]
# Tests marked megatron_lm (Megatron-LM's own trainer, megatron.training) are deselected by
# tests/conftest.py where megatron-core has no megatron.training: pass 1 (0.16.1); pass 2 runs them.
# Test paths among the arguments select what runs: pass 1 runs them, pass 2 those of them that
# are integration or end-to-end tests. SDP4BIT_SKIP_MCORE019=1 skips pass 2.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
# One intra-op thread per process, as torchrun gives each of its workers: the passes run side
# by side, each with processes of its own, and more threads than cores only wait for each
# other (the unit tests alone took 6% less CPU with one).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Python's bytecode cache for this tree (__pycache__, ignored by git): with
# PYTHONDONTWRITEBYTECODE set, every fresh interpreter and every rank compiles this project's
# modules from source again (0.3 s of CPU per trainer rank).
unset PYTHONDONTWRITEBYTECODE
# The environments' modules are byte-compiled by the first test processes that import them
# (tools/setup_env.sh would otherwise import them first, 8 s of CPU before any test starts).
export SDP4BIT_COMPILE_ON_IMPORT=1

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
    # the unit tests first: they overlap with pass 2
    first=(tests/unit tests/gpu tests/distributed tests/e2e) second=("${SECOND_PASS[@]}")
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

pass1() {
    (
        set -e
        source tools/setup_env.sh
        version="$(python -c 'from megatron.core import package_info as p; print(p.__version__)' \
            2>/dev/null)"
        echo "== pass 1: ${first[*]} with megatron-core ${version%%+*} (.venv)"
        SDP4BIT_TEST_PASS="$pass1_role" "${PYTEST[@]}" "${options[@]}" "${first[@]}"
    )
}

pass2() {
    (
        set -e
        # megatron-core 0.19.2 over .venv's other packages (created first, by pass 1's setup)
        export SDP4BIT_VENV=.venv-mcore019 SDP4BIT_MEGATRON_CORE="$MCORE_NEW" \
            SDP4BIT_BASE_VENV=.venv
        source tools/setup_env.sh
        echo "== pass 2: ${second[*]} with megatron-core $MCORE_NEW (.venv-mcore019, test-only)"
        # The tests check that this is the megatron-core they run against.
        # Of the tests marked release_independent (SDP4Bit's own checks, run once), the
        # end-to-end ones run here, the integration ones in pass 1 (tests/conftest.py).
        SDP4BIT_EXPECT_MEGATRON_CORE="$MCORE_NEW" SDP4BIT_TEST_PASS=2 \
            "${PYTEST[@]}" "${options[@]}" "${second[@]}"
    )
}

set +e  # run both passes; each pass stops at its own first setup error
status2=skipped
if [ "${SDP4BIT_SKIP_MCORE019:-0}" = 1 ]; then
    skip2="SDP4BIT_SKIP_MCORE019=1"
elif [ ${#second[@]} -eq 0 ]; then
    skip2="no integration or end-to-end test selected"
else
    skip2=""
fi
# With both passes, pass 1 leaves the release-independent end-to-end tests to pass 2; alone,
# it runs everything.
pass1_role=1
[ -z "$skip2" ] || pass1_role=""
start=$SECONDS
if [ -n "$skip2" ]; then
    pass1
    status1=$?
    echo "== pass 2 (megatron-core $MCORE_NEW) skipped: $skip2"
elif [ "${SDP4BIT_SEQUENTIAL:-0}" = 1 ]; then
    pass1
    status1=$?
    pass2
    status2=$?
else
    # .venv first (a failure shows again in pass 1); pass 2 creates its own environment while
    # pass 1 runs (no test of pass 1 builds in the source tree, which that install uses).
    ( source tools/setup_env.sh ) || true
    log2="$(mktemp "${TMPDIR:-/tmp}/sdp4bit-pass2.XXXXXX")"
    echo "== pass 2 (megatron-core $MCORE_NEW) runs beside pass 1; its output follows pass 1's"
    pass2 > "$log2" 2>&1 &
    pid2=$!
    # (|| true: under set -e a failing command in the trap would become the exit status)
    trap 'kill "$pid2" 2>/dev/null || true; rm -f "$log2"' EXIT
    pass1
    status1=$?
    wait "$pid2"
    status2=$?
    cat "$log2"
    rm -f "$log2"
    trap - EXIT
fi
set -e

echo "== exit status: pass 1 $status1, pass 2 (megatron-core $MCORE_NEW) $status2" \
    "($(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s)"
[ "$status1" = 0 ] || exit "$status1"
[ "$status2" = 0 ] || [ "$status2" = skipped ] || exit "$status2"
