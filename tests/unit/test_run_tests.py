"""dev/run_tests.sh (the README's test command, CI's entry) returns what its passes return.

The real script runs in a scratch tree holding a copy of it, a ``setup_env.sh`` stand-in that
keeps this interpreter (so no environment is created), a requirements.txt naming the second
megatron-core, a ``megatron.core.package_info`` stand-in (the script prints the release it
tests; the real import takes seconds), the real tests/conftest.py and one-test files (unit,
integration, end-to-end, an integration and an end-to-end test marked
``release_independent``, and an end-to-end one marked ``main_environment`` too). Each test
fails in the pass named by ``FAIL_IN`` (``1``: the first pass, ``2``: the second, which the
script marks with SDP4BIT_TEST_PASS=2), so every combination of outcomes is a second of
pytest, and each test prints which pass ran it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

ONE_TEST = """\
import os

import pytest

pytestmark = [{marks}]


def test_in_this_pass():
    fail_in = os.environ.get("FAIL_IN", "")
    this_pass = "2" if os.environ.get("SDP4BIT_TEST_PASS") == "2" else "1"
    print(f"RAN {{__name__}} in pass {{this_pass}}")
    assert fail_in != this_pass, f"told to fail in pass {{this_pass}}"
"""
ONCE = "pytest.mark.release_independent"
MAIN = "pytest.mark.main_environment"


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
    for folder, name, marks in (("unit", "test_u.py", ""),
                                ("distributed", "test_integration_x.py", ""),
                                ("distributed", "test_integration_once.py", ONCE),
                                ("e2e", "test_e.py", ""), ("e2e", "test_e_once.py", ONCE),
                                ("e2e", "test_e_main.py", f"{ONCE}, {MAIN}")):
        (tmp_path / "tests" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / folder / name).write_text(ONE_TEST.format(marks=marks))
    (tmp_path / "tests" / "gpu").mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    release_independent: run once\n    main_environment: pass 1\n"
        "    megatron_lm: unused\n")
    return tmp_path


def run(tree: Path, fail_in: str = "", **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("SDP4BIT_", "PYTEST_"))}
    environ.update(FAIL_IN=fail_in, PYTHON=sys.executable, **env)
    return subprocess.run(["bash", "dev/run_tests.sh", "-s", "-p", "no:cacheprovider"],
                          cwd=tree, env=environ, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sequential", ["0", "1"], ids=["side_by_side", "one_after_other"])
def test_exit_status_is_zero_only_when_both_passes_pass(tree: Path, sequential: str) -> None:
    done = run(tree, SDP4BIT_SEQUENTIAL=sequential)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== exit status: pass 1 0, pass 2 (megatron-core 0.19.2) 0" in done.stdout
    # pass 1 runs all four folders' tests, pass 2 the integration and end-to-end ones; the
    # release-independent ones run once: the end-to-end one in pass 2, the other in pass 1,
    # and the one of the main environment in pass 1
    assert "megatron-core 0.16.1 (.venv)" in done.stdout
    assert done.stdout.count("5 passed, 1 deselected") == 1, done.stdout
    assert done.stdout.count("3 passed, 2 deselected") == 1, done.stdout
    ran = sorted(re.findall(r"RAN \w+ in pass \d", done.stdout))
    assert ran == ["RAN test_e in pass 1", "RAN test_e in pass 2", "RAN test_e_main in pass 1",
                   "RAN test_e_once in pass 2", "RAN test_integration_once in pass 1",
                   "RAN test_integration_x in pass 1", "RAN test_integration_x in pass 2",
                   "RAN test_u in pass 1"], done.stdout

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
    # alone, pass 1 runs every test, the release-independent end-to-end one included
    assert "6 passed" in done.stdout and "deselected" not in done.stdout, done.stdout
    assert "RAN test_e_once in pass 1" in done.stdout
