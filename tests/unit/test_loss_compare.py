"""tools/loss_compare.py: selecting iterations, comparing curves, the report (no training)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers.scripts import load_tool

lc = load_tool("tools/loss_compare.py")


def _curve(losses: dict[int, float], vals: dict[int, float]) -> tuple[list[dict], list[dict]]:
    train = [{"iteration": it, "lm_loss": v} for it, v in sorted(losses.items())]
    val = [{"iteration": it, "val_lm_loss": v} for it, v in sorted(vals.items())]
    return train, val


def test_select_iterations_spans_first_to_last():
    logged = list(range(5, 205, 5))  # 40 logged iterations
    got = lc.select_iterations(logged, 9)
    assert got[0] == 5 and got[-1] == 200
    assert len(got) == 9 and got == sorted(got) and set(got) <= set(logged)
    assert lc.select_iterations([5, 10], 9) == [5, 10]
    with pytest.raises(ValueError, match="no logged training iteration"):
        lc.select_iterations([], 3)


def test_compare_differences_to_baseline():
    base = _curve({5: 10.0, 10: 9.0}, {10: 8.0})
    worse = _curve({5: 10.5, 10: 9.5}, {10: 8.4})
    res = lc.compare({"baseline": base, "qW": worse}, points=9)
    assert res["train_iterations"] == [5, 10]
    assert res["train_loss"]["qW"] == {5: 10.5, 10: 9.5}
    assert res["final"]["baseline"]["val_diff"] == 0.0
    assert math.isclose(res["final"]["qW"]["val_diff"], 0.4)
    assert math.isclose(res["final"]["qW"]["val_diff_pct"], 5.0)
    assert res["final"]["qW"]["final_train_loss"] == 9.5


def test_compare_uses_only_common_iterations_and_refuses_mismatches():
    a = _curve({5: 1.0, 10: 1.0, 15: 1.0}, {15: 1.0})
    b = _curve({5: 2.0, 10: 2.0}, {10: 2.0})
    with pytest.raises(ValueError, match="last evaluation is at iteration 10, baseline's at 15"):
        lc.compare({"baseline": a, "TLq": b}, points=9)
    res = lc.compare({"baseline": a, "TLq": _curve({5: 2.0, 10: 2.0}, {15: 2.0})}, points=9)
    assert res["train_iterations"] == [5, 10]
    with pytest.raises(ValueError, match="no training iteration in common"):
        lc.compare({"baseline": a, "TLq": _curve({7: 1.0}, {})}, points=9)


def test_report_renders_every_method_and_round_trips_json(tmp_path):
    curves = {"baseline": _curve({5: 10.0, 10: 9.0}, {10: 8.0}),
              "SDP4Bit": _curve({5: 10.1, 10: 9.1}, {10: 8.02})}
    report = {"meta": {"command": "python tools/loss_compare.py", "example_run": "torchrun ...",
                       "machine": {"cpu": "cpu", "cores": 2, "python": "3", "torch": "t",
                                   "triton": "t", "megatron_core": "m"},
                       "seconds": {"baseline": 1.0, "SDP4Bit": 2.0}, "date": "today"},
              "results": lc.compare(curves, points=9), "note": ""}
    md = lc.render_markdown(report)
    assert "| SDP4Bit | 8.0200 | +0.0200 | +0.25% | 9.1000 |" in md
    assert "| baseline | 8.0000 | +0.0000 | +0.00% | 9.0000 |" in md
    assert json.loads(json.dumps(report))["results"]["final"]["SDP4Bit"]["val_loss"] == 8.02


def test_methods_differ_only_in_their_sdp4bit_flags():
    common = lc.model_flags(200, 50, 8, 1234)
    cmds = {m: lc.command(m, Path("m.jsonl"), common, []) for m in lc.METHODS}
    assert cmds["baseline"][:5] == ["torchrun", "--standalone", "--nproc-per-node", "4",
                                    "pretrain_gpt.py"]
    for m, cmd in cmds.items():
        assert "--use-distributed-optimizer" in cmd and "--bf16" in cmd
        assert cmd[cmd.index("--dp-ranks-per-node") + 1] == "2"
    assert "--hadamard-transform" not in cmds["TLq"] and "--hadamard-transform" in cmds["SDP4Bit"]
    ulq = cmds["ULq"]
    assert ulq[ulq.index("--gradient-quantization-bits-intra") + 1] == "4"
    qw = cmds["qW"]
    assert qw[qw.index("--weight-quantization-mode") + 1] == "direct"
