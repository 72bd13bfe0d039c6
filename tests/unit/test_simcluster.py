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


def test_moe_results_go_to_their_own_files_and_a_shaped_link_alone_has_no_model(tmp_path):
    from dev.simcluster.__main__ import MODELS, parse_args, trainer_args

    args = parse_args(["1gbit", "--model", "moe", "--methods", "baseline", "SDP4Bit"])
    flags = trainer_args("SDP4Bit", args)
    assert flags[flags.index("--num-experts") + 1] == "4"
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "2"
    assert "--num-experts" not in trainer_args("SDP4Bit", parse_args(["1gbit"]))
    links = [{"rate": "1gbit", "configured_bits": 1e9, "measured_bits": 9.5e8}]
    runs = [_run("1gbit", "baseline", [600], 40), _run("1gbit", "SDP4Bit", [300], 4)]
    result = report.summarize(links, runs, ["baseline", "SDP4Bit"])
    (row,) = result["links"]
    # no unshaped link: the no-overlap model has no wire-free time to start from
    assert row["wire_bound_speedup"] == pytest.approx(10.0) and "model_speedup" not in row
    _, description, stem = MODELS["moe"]
    result.update(model=description, stem=stem)
    paths = report.write(result, tmp_path, stem)
    assert [p.name for p in paths] == ["simcluster_moe.json", "simcluster_moe.md",
                                       "simcluster_moe.png"]
    text = paths[1].read_text()
    assert f"the same {description} for every method" in text
    assert "| 1gbit | 950 Mbit/s | 0.600 | 0.300 | 2.00x | 10.00x | - |" in text
    assert not (tmp_path / "simcluster.md").exists()
    # a results file that names no model (the dense one's) keeps its description
    assert report.DENSE_MODEL in report.markdown(report.summarize(links, runs, ["baseline"]))
