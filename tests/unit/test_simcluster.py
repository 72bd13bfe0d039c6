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
            "counted_inter_bytes_per_iter": 1e6, "counted_grad_inter_bytes_per_iter": 5e5,
            "load_average": 2.0, "timers_ms": {}}


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


def test_peer_methods_are_valid_trainer_command_lines_and_write_their_own_results():
    from dev.simcluster.__main__ import PAPER_METHODS, parse_args, results_stem, trainer_args
    from megatron.sdp4bit.training.cli.arguments import parse_args as trainer_parse

    peers = ["baseline", "SDP4Bit", "SDP4Bit-2bit", "baseline-bf16", "baseline-bf16-a2a"]
    args = parse_args(["1gbit", "100mbit", "--methods", *peers])
    for method in peers:  # full validation, as pretrain_gpt.py does on 4 ranks
        trainer_parse(trainer_args(method, args) + ["--train-iters", "11"], world_size=4)
    two_bit = trainer_args("SDP4Bit-2bit", args)
    assert two_bit[two_bit.index("--gradient-quantization-bits-inter") + 1] == "2"
    assert "--gradient-quantization-bits-inter" not in trainer_args("SDP4Bit", args)
    # megatron-core overlaps the all-to-all reduce-scatter with one bucket only: no overlap
    a2a = trainer_args("baseline-bf16-a2a", args)
    assert "--overlap-grad-reduce" not in a2a and "--overlap-param-gather" not in a2a
    assert {"--grad-reduce-in-bf16", "--overlap-grad-reduce"} <= set(
        trainer_args("baseline-bf16", args))
    assert results_stem(args) == "simcluster_peers"
    assert results_stem(parse_args(["--methods", *peers, "--model", "moe"])) == \
        "simcluster_moe_peers"
    # the paper's methods (all, or some) keep the results files of benchmarks/simcluster.md
    assert parse_args([]).methods == PAPER_METHODS
    assert results_stem(parse_args(["--methods", "baseline", "SDP4Bit"])) == "simcluster"


def test_peer_report_has_each_methods_bytes_and_the_two_bit_accounting(tmp_path):
    links = [{"rate": "100mbit", "configured_bits": 1e8, "measured_bits": 9.6e7}]
    runs = []
    for method, ms, link_mb, grads in (("baseline", 4000, 50, 13.4), ("SDP4Bit-2bit", 400, 4, 0.94),
                                       ("baseline-bf16", 2500, 30, 6.7)):
        run = _run("100mbit", method, [ms], link_mb)
        run.update(counted_inter_bytes_per_iter=(grads + 13.4) * 1e6,
                   counted_grad_inter_bytes_per_iter=grads * 1e6, load_average=3.0)
        runs.append(run)
    methods = ["baseline", "SDP4Bit-2bit", "baseline-bf16"]
    result = report.summarize(links, runs, methods)
    result["stem"] = "simcluster_peers"
    text = report.markdown(result)
    assert "SDP4Bit and its peers" in text
    assert "| 100mbit | 96 Mbit/s | SDP4Bit-2bit | 0.400 | 0.400 | 10.00x | 12.50x | 4.0 | " \
        "14.34 | 0.94 | 3.0 |" in text
    assert "| 100mbit | 96 Mbit/s | baseline-bf16 | 2.500 | 2.500 | 1.60x | 1.67x | 30.0 |" in text
    assert "- SDP4Bit-2bit: gradients 13.40 -> 0.94 MB (14.26x fewer; the accounting " \
        "32 / (2 + 32/128) = 14.2x), the whole step (parameters + gradients) 26.80 -> 14.34 " \
        "MB (1.87x fewer)" in text
    assert "- baseline-bf16: gradients 13.40 -> 6.70 MB (2.00x fewer), the whole" in text
    assert "`--grad-reduce-in-bf16`" in text
    paths = report.write(result, tmp_path, result["stem"])
    assert [p.name for p in paths] == ["simcluster_peers.json", "simcluster_peers.md",
                                       "simcluster_peers.png"]
