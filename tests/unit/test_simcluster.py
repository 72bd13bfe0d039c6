"""The simulated-cluster benchmark's arithmetic (the runs themselves need root: not in CI)."""

from __future__ import annotations

import pytest

from dev.simcluster import netns, report
from dev.simcluster.launch import _bytes_at


def test_rates_parse():
    assert netns.parse_rate("none") is None
    assert netns.parse_rate("100mbit") == 1e8
    assert netns.parse_rate("1.5gbit") == 1.5e9
    with pytest.raises(ValueError, match="link rate '10mb': use none or a number with kbit"):
        netns.parse_rate("10mb")


def test_link_bytes_are_interpolated_between_samples():
    samples = [(0.0, 0, 0), (1.0, 1000, 10), (2.0, 3000, 30)]
    assert _bytes_at(samples, 1.5, 1) == 2000 and _bytes_at(samples, 0.5, 2) == 5
    with pytest.raises(ValueError, match="outside the sampled interval"):
        _bytes_at(samples, 2.5, 1)


def _run(rate, method, ms, link_mb):
    return {"rate": rate, "method": method, "ms_per_iter": ms,
            "link_bytes_per_iter": [link_mb * 1e6, link_mb * 1e6],
            "counted_inter_bytes_per_iter": 1e6, "load_average": 2.0, "timers_ms": {}}


def test_summary_medians_speedups_and_bounds():
    links = [{"rate": "none", "configured_bits": None, "measured_bits": 1e10},
             {"rate": "100mbit", "configured_bits": 1e8, "measured_bits": 1e8}]
    runs = [_run("none", "baseline", [300, 290, 310], 50), _run("none", "SDP4Bit", [250], 5),
            _run("none", "baseline", [200], 50),
            _run("100mbit", "baseline", [4500, 4400], 50), _run("100mbit", "SDP4Bit", [500], 5)]
    result = report.summarize(links, runs, ["baseline", "SDP4Bit"])
    none, slow = result["links"]
    # medians over the rounds of each run's median: baseline rounds 0.300 and 0.200
    assert none["methods"]["baseline"]["s_per_iter"] == pytest.approx(0.25)
    assert none["methods"]["SDP4Bit"]["speedup"] == pytest.approx(1.0)
    assert slow["methods"]["SDP4Bit"]["speedup"] == pytest.approx(4.45 / 0.5)
    assert slow["wire_bound_speedup"] == pytest.approx(10.0)
    # no-overlap model: (t_b + 50 MB * 8 / 1e8) / (t_q + 5 MB * 8 / 1e8)
    assert slow["model_speedup"] == pytest.approx((0.25 + 4.0) / (0.25 + 0.4))
    text = report.markdown(result)
    assert "| 100mbit | 100 Mbit/s | 4.450 | 0.500 | 8.90x | 10.00x | 6.54x |" in text
