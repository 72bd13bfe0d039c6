"""Puts this folder on ``sys.path`` so that helpers shared by the test folders (``_noise.py``)
import by name, in pytest and in the processes the distributed tests spawn (spawn passes
``sys.path`` on).

In ``tools/run_tests.sh``'s second pass (``SDP4BIT_RELEASE_PASS=1``: the integration and
end-to-end tests again, against the other megatron-core release) the tests marked
``release_independent`` are deselected (pytest counts them as deselected, not as passed):
they test what no megatron-core release can change (SDP4Bit's own input, file, lock, resume
and process checks, torchrun's rendezvous, the README's commands), or cases whose
megatron-core paths another test of that pass takes (each mark says which); the first pass
runs them all.
"""

import os
import pathlib
import sys

_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SDP4BIT_RELEASE_PASS") != "1":
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("release_independent") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
