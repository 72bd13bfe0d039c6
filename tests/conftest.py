"""The test session's settings. The tests import their shared code as the package
``tests.helpers`` (the repository's root is on ``sys.path``: pyproject.toml's ``pythonpath``).

In ``dev/run_tests.sh``'s second pass (``SDP4BIT_RELEASE_PASS=1``: the integration and
end-to-end tests again, against the other megatron-core release) the tests marked
``release_independent`` are deselected (pytest counts them as deselected, not as passed):
they test what no megatron-core release can change (SDP4Bit's own input, file, lock, resume
and process checks, torchrun's rendezvous, the README's commands), or cases whose
megatron-core paths another test of that pass takes (each mark says which); the first pass
runs them all. Tests marked ``megatron_lm_parser`` read Megatron-LM's own parser, which only
megatron-core 0.19.2's wheel ships: the second pass runs them and the first deselects them.
"""

import os


def pytest_collection_modifyitems(config, items):
    # Deselected in this pass: release_independent in the second, megatron_lm_parser in the first.
    marker = ("release_independent" if os.environ.get("SDP4BIT_RELEASE_PASS") == "1"
              else "megatron_lm_parser")
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker(marker) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
