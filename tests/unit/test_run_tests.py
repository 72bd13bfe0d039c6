"""dev/run_tests.sh (the README's test command, CI's entry) returns what its passes return.

The real script runs in a scratch tree holding a copy of it, a ``setup_env.sh`` stand-in that
keeps this interpreter (so no environment is created), a requirements.txt naming the second
megatron-core, a ``megatron.core.package_info`` stand-in (the script prints the release it
tests; the real import takes seconds) and three one-test files (unit, integration, end-to-end). Each test fails in
the pass named by ``FAIL_IN`` (``1``: the first pass, ``2``: the second, which the script
marks with SDP4BIT_RELEASE_PASS=1), so every combination of outcomes is a second of pytest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

ONE_TEST = """\
import os

def test_in_this_pass():
    fail_in = os.environ.get("FAIL_IN", "")
    this_pass = "2" if os.environ.get("SDP4BIT_RELEASE_PASS") == "1" else "1"
    assert fail_in != this_pass, f"told to fail in pass {this_pass}"
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "tools").mkdir()
    (tmp_path / "dev").mkdir()
    shutil.copy(REPO / "dev" / "run_tests.sh", tmp_path / "dev" / "run_tests.sh")
    # the stand-in: this interpreter's environment, whatever SDP4BIT_VENV says
    (tmp_path / "tools" / "setup_env.sh").write_text(
        f'export PATH="{Path(sys.executable).parent}:$PATH" PYTHONPATH="{tmp_path / "stub"}"\n')
    (tmp_path / "stub" / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "stub" / "megatron" / "core" / "__init__.py").write_text("")
    (tmp_path / "stub" / "megatron" / "core" / "package_info.py").write_text(
        '__version__ = "0.16.1"\n')
    (tmp_path / "requirements.txt").write_text(
        'megatron-core==0.16.1; python_version < "3.12"\n'
        'megatron-core==0.19.2; python_version >= "3.12"\n')
    for folder, name in (("unit", "test_u.py"), ("distributed", "test_integration_x.py"),
                         ("e2e", "test_e.py")):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / name).write_text(ONE_TEST)
    (tmp_path / "tests" / "gpu").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return tmp_path


def run(tree: Path, fail_in: str = "", **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("SDP4BIT_", "PYTEST_"))}
    environ.update(FAIL_IN=fail_in, PYTHON=sys.executable, **env)
    return subprocess.run(["bash", "dev/run_tests.sh", "-p", "no:cacheprovider"],
                          cwd=tree, env=environ, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sequential", ["0", "1"], ids=["side_by_side", "one_after_other"])
def test_exit_status_is_zero_only_when_both_passes_pass(tree: Path, sequential: str) -> None:
    done = run(tree, SDP4BIT_SEQUENTIAL=sequential)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== exit status: pass 1 0, pass 2 (megatron-core 0.19.2) 0" in done.stdout
    # pass 1 runs all four folders' tests, pass 2 the integration and end-to-end ones
    assert "megatron-core 0.16.1 (.venv)" in done.stdout
    assert "3 passed" in done.stdout and "2 passed" in done.stdout, done.stdout

    for fail_in, expected in (("1", "pass 1 1, pass 2 (megatron-core 0.19.2) 0"),
                              ("2", "pass 1 0, pass 2 (megatron-core 0.19.2) 1")):
        done = run(tree, fail_in, SDP4BIT_SEQUENTIAL=sequential)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"== exit status: {expected}" in done.stdout
        assert f"told to fail in pass {fail_in}" in done.stdout


def test_no_second_pass_when_asked(tree: Path) -> None:
    done = run(tree, "2", SDP4BIT_SKIP_MCORE019="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== pass 2 (megatron-core 0.19.2) skipped: SDP4BIT_SKIP_MCORE019=1" in done.stdout
