"""The test session's settings. The tests import their shared code as the package
``tests.helpers`` (the repository's root is on ``sys.path``: pyproject.toml's ``pythonpath``).

In ``dev/run_tests.sh``'s second pass (``SDP4BIT_RELEASE_PASS=1``: the integration and
end-to-end tests again, against the other megatron-core release) the tests marked
``release_independent`` are deselected (pytest counts them as deselected, not as passed):
they test what no megatron-core release can change (SDP4Bit's own input, file, lock, resume
and process checks, torchrun's rendezvous, the README's commands), or cases whose
megatron-core paths another test of that pass takes (each mark says which); the first pass
runs them all.
"""

import os


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SDP4BIT_RELEASE_PASS") != "1":
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("release_independent") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
