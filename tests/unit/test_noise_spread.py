"""benchmarks/noise_spread.py: its arithmetic, and that the recorded figure was measured on the
runs tests/e2e/test_dist_checkpoint.py resumes (same layouts, iterations, factor)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _tool():
    from benchmarks import noise_spread

    return noise_spread


def test_pair_differences_and_rms():
    tool = _tool()
    losses = {7: {5: 4.0, 6: 2.0}, 8: {5: 4.4, 6: 2.0}, 9: {5: 3.6, 6: 2.2}}
    diffs = tool.pair_differences(losses, (5, 6))
    # pairs (7, 8), (7, 9), (8, 9), each at iterations 5 and 6; relative to the first seed
    expected = [0.4 / 4.0, 0.0, 0.4 / 4.0, 0.2 / 2.0, 0.8 / 4.4, 0.2 / 2.0]
    assert all(math.isclose(a, b) for a, b in zip(diffs, expected)) and len(diffs) == 6
    assert math.isclose(tool.rms([3.0, 4.0]), math.sqrt(12.5))


def test_recorded_spread_matches_the_test():
    from benchmarks.noise_spread import (LAYOUTS, NOISE_FACTOR, NOISE_ITERATIONS, NOISE_RECORD,
                                         noise_bound)

    record = json.loads(Path(NOISE_RECORD).read_text())
    assert record["iterations"] == list(NOISE_ITERATIONS)
    assert set(record["layouts"]) == set(LAYOUTS)
    for name, (nproc, flags) in LAYOUTS.items():
        layout = record["layouts"][name]
        assert (layout["nproc"], layout["flags"]) == (nproc, flags), name
        assert len(layout["losses"]) == len(record["seeds"]) >= 2
        losses = {int(s): {int(i): v for i, v in d.items()}
                  for s, d in layout["losses"].items()}
        tool = _tool()
        assert math.isclose(layout["rms"], tool.rms(tool.pair_differences(losses,
                                                                          NOISE_ITERATIONS)))
    largest = max(r["rms"] for r in record["layouts"].values())
    assert math.isclose(noise_bound(), NOISE_FACTOR * largest)
