"""The test session's settings. The tests import their shared code as the package
``tests.helpers`` (the repository's root is on ``sys.path``: pyproject.toml's ``pythonpath``).

The tests marked ``release_independent`` test what no megatron-core release can change
(SDP4Bit's own input, file, lock, resume and process checks, torchrun's rendezvous, the
README's commands), or cases whose megatron-core paths another test of the second pass takes
(each mark says which): ``dev/run_tests.sh`` runs each of them once. It tells each pass which
one it is (``SDP4BIT_TEST_PASS``, set only when both passes run):

* ``2``, the integration and end-to-end tests again, against the other megatron-core
  release: the ``release_independent`` integration tests are deselected (pass 1 runs them),
  its ``release_independent`` end-to-end tests run here;
* ``1``, the whole suite: the ``release_independent`` end-to-end tests are deselected (pass 2
  runs them). Pass 1 holds the unit tests, so this split lets the two passes, which run side
  by side, end at about the same time.

A test marked ``main_environment`` runs what a user runs as the README says (its commands),
so it runs in pass 1, the environment ``tools/setup_env.sh`` makes for this Python, and is
deselected in pass 2's test-only one. Without the variable (a plain ``pytest``, or the
script with its second pass skipped) everything runs. Deselected tests are counted as such
by pytest, never as passed.

The tests marked ``megatron_lm`` run Megatron-LM's own trainer or read its argument parser
(``megatron.training``, which
megatron-core's wheel ships from 0.17 on): where the installed megatron-core has none (0.16.1,
the first pass) they are deselected, counted as such, never skipped silently.
"""

import importlib.util
import os
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def _runs_elsewhere(item, test_pass: str) -> bool:
    """A test that the other pass runs (see the module's docstring)."""
    if test_pass not in ("1", "2"):
        return False
    if item.get_closest_marker("main_environment"):
        return test_pass == "2"
    if not item.get_closest_marker("release_independent"):
        return False
    end_to_end = Path(str(item.path)).resolve().parent == E2E
    return end_to_end == (test_pass == "1")


def pytest_collection_modifyitems(config, items):
    test_pass = os.environ.get("SDP4BIT_TEST_PASS", "")
    if test_pass not in ("", "1", "2"):
        raise pytest.UsageError(f"SDP4BIT_TEST_PASS={test_pass!r}: use 1 or 2, or leave it unset")
    training = _has_megatron_training()
    keep, drop = [], []
    for item in items:
        deselect = (_runs_elsewhere(item, test_pass)
                    or not training and item.get_closest_marker("megatron_lm"))
        (drop if deselect else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
