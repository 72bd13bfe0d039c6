"""megatron.sdp4bit installs as a portion of the ``megatron`` namespace beside megatron-core."""

import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
PROBE = ("import megatron.core, megatron.sdp4bit, megatron.sdp4bit.quantization; "
         "print(megatron.core.__file__); print(megatron.sdp4bit.__file__)")
# The installed package builds and runs its CPU kernels from the C source it ships.
KERNEL_PROBE = ("from megatron.sdp4bit.quantization import cpu_kernels as ck; "
                "assert ck.unavailable_reason() is None, ck.unavailable_reason(); "
                "print(ck.SOURCE)")


def test_megatron_has_no_init():
    assert not (REPO / "megatron" / "__init__.py").exists()


def test_current_install_imports_both():
    out = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True,
                         text=True, cwd="/").stdout.split()
    core, sdp = out[-2:]
    assert "site-packages" in core
    assert pathlib.Path(sdp).is_relative_to(REPO) or "site-packages" in sdp


def test_regular_install_imports_both(tmp_path):
    """A non-editable install (a wheel unpacked into a target dir) must not hide megatron.core."""
    target = tmp_path / "site"
    # built from a copy: pip builds in the source tree (build/, *.egg-info), and the test
    # command creates its second environment's editable install of the repository meanwhile
    source_tree = tmp_path / "src"
    shutil.copytree(REPO, source_tree, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", "runs", "data", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(target), str(source_tree)],
                   check=True, capture_output=True)
    assert not (target / "megatron" / "__init__.py").exists()
    env = dict(os.environ, PYTHONPATH=str(target), SDP4BIT_CACHE_DIR=str(tmp_path / "cache"))
    # one interpreter for both probes (a fresh one imports torch and megatron-core: seconds)
    out = subprocess.run([sys.executable, "-c", f"{PROBE}\n{KERNEL_PROBE}"], check=True,
                         capture_output=True, text=True, env=env, cwd="/").stdout.split()
    core, sdp, source = out[-3:]
    assert pathlib.Path(sdp).is_relative_to(target)
    assert "site-packages" in core and not pathlib.Path(core).is_relative_to(target)
    assert pathlib.Path(source).is_relative_to(target)
