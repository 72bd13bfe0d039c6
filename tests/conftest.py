"""The test session's settings. The tests import their shared code as the package
``tests.helpers`` (the repository's root is on ``sys.path``: pyproject.toml's ``pythonpath``).

In ``dev/run_tests.sh``'s second pass (``SDP4BIT_RELEASE_PASS=1``: the integration and
end-to-end tests again, against the other megatron-core release) the tests marked
``release_independent`` are deselected (pytest counts them as deselected, not as passed):
they test what no megatron-core release can change (SDP4Bit's own input, file, lock, resume
and process checks, torchrun's rendezvous, the README's commands), or cases whose
megatron-core paths another test of that pass takes (each mark says which); the first pass
runs them all.

The tests marked ``megatron_lm`` run Megatron-LM's own trainer or read its argument parser
(``megatron.training``, which
megatron-core's wheel ships from 0.17 on): where the installed megatron-core has none (0.16.1,
the first pass) they are deselected, counted as such, never skipped silently.
"""

import importlib.util
import os


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items):
    release_pass = os.environ.get("SDP4BIT_RELEASE_PASS") == "1"
    training = _has_megatron_training()
    keep, drop = [], []
    for item in items:
        deselect = (release_pass and item.get_closest_marker("release_independent")
                    or not training and item.get_closest_marker("megatron_lm"))
        (drop if deselect else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
