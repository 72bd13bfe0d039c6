# Sourced, not run: creates (once) and activates a virtual environment with the pinned
# packages of requirements.txt and this project in editable mode. Re-running only checks the
# pins. Settings (environment variables):
#   SDP4BIT_VENV            the environment's folder (default .venv)
#   SDP4BIT_MEGATRON_CORE   a megatron-core version to install instead of the one
#                           requirements.txt picks for this Python, with --no-deps
#                           --ignore-requires-python. Test-only: dev/run_tests.sh uses it to
#                           test megatron-core 0.19.2 (which requires Python >= 3.12) on 3.11;
#                           there a .pth file gives every interpreter of the environment
#                           Python 3.12's typing.override (Megatron-LM's trainer imports it).
#   SDP4BIT_BASE_VENV       with SDP4BIT_MEGATRON_CORE: an environment set up by this script
#                           whose packages the new one reads (a .pth line puts its
#                           site-packages after the new one's), so that only megatron-core and
#                           this project are installed (test-only: seconds instead of a minute).
#   SDP4BIT_COMPILE_ON_IMPORT=1  no byte-compiling at set-up: each module is compiled where it
#                           is first imported (dev/run_tests.sh, whose tests import them).
set -euo pipefail
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
_venv="${SDP4BIT_VENV:-.venv}"
_mcore="${SDP4BIT_MEGATRON_CORE:-}"
_base=""
if [ -n "$_mcore" ] && [ -n "${SDP4BIT_BASE_VENV:-}" ]; then
    _base="$(cd "$SDP4BIT_BASE_VENV" && pwd)"
    [ -f "$_base/.installed" ] || { echo "setup_env.sh: SDP4BIT_BASE_VENV=$SDP4BIT_BASE_VENV" \
        "is not an environment set up by this script" >&2; return 2; }
fi
_stamp="$_venv/.installed"
_want="requirements.txt${_mcore:+ megatron-core==$_mcore}${_base:+ over $_base}"

# pip, quiet, without the notices some machines' pip.conf causes for absent local indexes
_sdp4bit_pip() {
    python -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

if [ ! -x "$_venv/bin/python" ]; then
    echo "== creating $_venv ($("$PYTHON" --version 2>&1))"
    # Over a base environment, its pip and setuptools are used (no older copies in front).
    "$PYTHON" -m venv ${_base:+--without-pip} "$_venv"
fi
source "$_venv/bin/activate"
# (found, not imported: importing megatron-core takes seconds, and every test pass sources this)
if ! python -c "import importlib.util as u; assert all(u.find_spec(m) for m in
    ('megatron.sdp4bit', 'megatron.core', 'torch', 'triton'))" >/dev/null 2>&1 \
    || [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ] \
    || [ requirements.txt -nt "$_stamp" ] || [ setup.py -nt "$_stamp" ]; then
    if [ -n "$_base" ]; then
        # Every other package (pip too) from the base environment, after this one's own.
        echo "== $_venv: the packages of $_base, megatron-core apart (test-only)"
        _site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        _base_site="$("$_base/bin/python" -c \
            'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        echo "import site; site.addsitedir('$_base_site')" > "$_site/_sdp4bit_base_venv.pth"
        # and its commands (torchrun, ...), run by this environment's interpreter
        for _cmd in "$_base"/bin/*; do
            [ -e "$_venv/bin/${_cmd##*/}" ] && continue
            head -n 1 "$_cmd" 2>/dev/null | grep -qx "#!$_base/bin/python[0-9.]*" || continue
            { echo "#!$(cd "$_venv" && pwd)/bin/python"; tail -n +2 "$_cmd"; } \
                > "$_venv/bin/${_cmd##*/}"
            chmod +x "$_venv/bin/${_cmd##*/}"
        done
        unset _site _base_site _cmd
    else
        echo "== $_venv: installing the pinned packages of requirements.txt (first run: a few minutes)"
        _sdp4bit_pip install -q --upgrade pip
    fi
    if [ -n "$_mcore" ]; then
        if [ -z "$_base" ]; then
            # Everything but megatron-core, which comes next, unchecked against this Python.
            grep -v -i "^megatron[-_]core" requirements.txt > "$_venv/requirements-no-mcore.txt"
            _sdp4bit_pip install -q --no-compile -r "$_venv/requirements-no-mcore.txt"
        fi
        echo "== $_venv: installing megatron-core==$_mcore with --ignore-requires-python (test-only)"
        _sdp4bit_pip install -q --no-compile --no-deps --ignore-requires-python \
            "megatron-core==$_mcore"
    else
        _sdp4bit_pip install -q --no-compile -r requirements.txt
    fi
    echo "== $_venv: installing this project (editable)"
    _sdp4bit_pip install -q --no-deps -e .
    # Byte-compiled by importing, not at install: pip would compile all 12,000 files it
    # installs (27 s of CPU), most of them never imported; importing what a run imports
    # compiles 3,200 of them (8 s of CPU), and anything else is compiled where it is first
    # imported, as Python does. Written even where PYTHONDONTWRITEBYTECODE is set, which
    # would otherwise make every process compile torch again. SDP4BIT_COMPILE_ON_IMPORT=1
    # leaves all of it to the first imports (dev/run_tests.sh: its first test processes
    # import all of this anyway).
    if [ "${SDP4BIT_COMPILE_ON_IMPORT:-0}" != 1 ]; then
        echo "== $_venv: compiling the modules this project imports"
        # (torchrun's, a training run's, the tokenizers' and the tools': all that the
        # quickstart imports but a few small modules)
        PYTHONDONTWRITEBYTECODE= python -W ignore -c "import torch.distributed.run
import megatron.sdp4bit.training.loop, megatron.sdp4bit.training.build
import megatron.sdp4bit.training.sdp4bit_setup, megatron.sdp4bit.training.cli.arguments
import megatron.sdp4bit.integration.install, megatron.core.datasets.helpers
import megatron.core.datasets.indexed_dataset, tokenizers, torch.utils.tensorboard
import transformers.models.auto.tokenization_auto, matplotlib.pyplot
import matplotlib.backends.backend_agg" \
            || { echo "setup_env.sh: importing this project's modules failed in $_venv" >&2
                 return 1; }
    fi
    echo "$_want" > "$_stamp"
fi
if [ -n "$_mcore" ]; then
    # A megatron-core whose wheel requires a newer Python than this one (0.19.2: >= 3.12, on
    # 3.11): every interpreter of this environment gets Python 3.12's typing.override at
    # start-up, from a .pth file, so that a process Megatron-LM's trainer spawns has it too.
    # On a Python the wheel accepts (>= 3.12 for 0.19.2) none of this is needed: nothing is
    # written, and a stale file is removed.
    # [Note: the Python 3.12 bridge in every process] (integration/megatron_lm_bridges.py)
    python - <<'PY'
import importlib.metadata, os, platform, sysconfig
from packaging.specifiers import SpecifierSet
needs = importlib.metadata.metadata("megatron-core")["Requires-Python"] or ""
path = os.path.join(sysconfig.get_paths()["purelib"], "sdp4bit_python312_bridge.pth")
if SpecifierSet(needs).contains(platform.python_version()):
    if os.path.exists(path):
        os.remove(path)
else:
    with open(path, "w") as f:
        f.write("import megatron.sdp4bit.integration.megatron_lm_bridges as b; "
                "b.bridge_python_312()\n")
PY
fi
unset -f _sdp4bit_pip
unset _venv _mcore _base _stamp _want
set +euo pipefail
