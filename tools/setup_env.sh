# Sourced, not run: creates (once) and activates .venv with the pinned packages and
# this project installed in editable mode. Re-running only checks the pins.
set -euo pipefail
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
source .venv/bin/activate
if ! python -c "import megatron.sdp4bit, megatron.core, torch, triton" >/dev/null 2>&1 \
    || [ requirements.txt -nt .venv/.installed ] || [ setup.py -nt .venv/.installed ]; then
    python -m pip install -q --upgrade pip
    python -m pip install -q -r requirements.txt
    python -m pip install -q --no-deps -e .
    touch .venv/.installed
fi
set +euo pipefail
