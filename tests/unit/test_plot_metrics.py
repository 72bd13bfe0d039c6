"""tools/plot_metrics.py and loss_compare.py's picture and noise band (no training)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_tool

pm = load_tool("tools/plot_metrics.py")
lc = load_tool("tools/loss_compare.py")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def write_run(folder: Path, loss0: float, quantized: bool, tokens: bool = True) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for it in range(5, 65, 5):
        r = {"iteration": it, "lm_loss": loss0 - it / 20, "elapsed_ms": 100.0 + it,
             "consumed_samples": 16 * it}
        if tokens:
            r["consumed_tokens"] = 16 * 128 * it
        for key, full in (("params_intra", 5e6), ("params_inter", 5e6),
                          ("grads_intra", 6.7e6), ("grads_inter", 3.3e6)):
            r["comm_bytes_" + key] = int(full / (4 if quantized else 1))
            r["baseline_comm_bytes_" + key] = int(full)
        lines.append(json.dumps(r))
    lines.append(json.dumps({"iteration": 60, "val_lm_loss": loss0 - 3.1, "val_lm_ppl": 1.0}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_two_runs_into_one_png(tmp_path, capsys):
    a = write_run(tmp_path / "base", 10.0, quantized=False)
    b = write_run(tmp_path / "sdp", 10.1, quantized=True)
    out = tmp_path / "cmp.png"
    assert pm.main([str(a), f"{b / 'metrics.jsonl'}=SDP4Bit", "--x", "tokens", "-o", str(out),
                    "--title", "t"]) == 0
    assert png_size(out) == (1080, 312)  # 13.5 x 3.9 inches at 80 dpi
    assert out.stat().st_size < 150_000
    runs = [pm.Run(str(a)), pm.Run(f"{b}=SDP4Bit")]
    assert [r.label for r in runs] == ["base", "SDP4Bit"]
    assert runs[0].x(runs[0].val, "tokens") == [60 * 16 * 128]


def test_tokens_follow_a_growing_batch(tmp_path):
    """--rampup-batch-size: 4 samples of 128 tokens per iteration up to 20, then 8; the
    validation loss at 30 sits between the logged 20 and 40."""
    folder = tmp_path / "ramp"
    folder.mkdir()
    consumed = {10: 40, 20: 80, 40: 240}
    lines = [{"iteration": it, "lm_loss": 5.0, "elapsed_ms": 1.0, "consumed_samples": c,
              "consumed_tokens": 128 * c} for it, c in consumed.items()]
    lines.append({"iteration": 30, "val_lm_loss": 4.0, "val_lm_ppl": 1.0})
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    run = pm.Run(str(folder))
    assert run.x(run.train, "tokens") == [128 * 40, 128 * 80, 128 * 240]
    assert run.x(run.val, "tokens") == [128 * 160]


def test_bad_input_is_one_line(tmp_path, capsys):
    assert pm.main([str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err == (f"plot_metrics.py: error: {tmp_path / 'nope'}: no such "
                                       "metrics file (pass a --metrics-jsonl file or the folder "
                                       "holding metrics.jsonl)\n")
    old = write_run(tmp_path / "old", 10.0, quantized=True, tokens=False)
    assert pm.main([str(old), "--x", "tokens", "-o", str(tmp_path / "x.png")]) == 1
    assert "no consumed_tokens in its records" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(SystemExit) as info:
        pm.pyplot("plot_metrics.py")
    assert str(info.value) == ("plot_metrics.py: drawing needs matplotlib: pip install "
                               "'matplotlib>=3.8' (it is in requirements.txt)")


def _records(losses: dict[int, float], val: float) -> tuple[list[dict], list[dict]]:
    return ([{"iteration": i, "lm_loss": v} for i, v in sorted(losses.items())],
            [{"iteration": max(losses), "val_lm_loss": val}])


def test_noise_band_is_the_range_over_seeds():
    base = _records({5: 9.0, 10: 8.0}, 7.0)
    others = {1235: _records({5: 9.1, 10: 8.2}, 7.14), 1236: _records({5: 8.9, 10: 7.9}, 6.93)}
    band = lc.noise_band(base, 1234, others)
    assert band["seeds"] == ["1234", "1235", "1236"]
    assert (band["min"], band["max"]) == (6.93, 7.14)
    assert band["spread_pct"] == pytest.approx(100 * 0.21 / 7.0)
    assert band["curves"]["1235"] == {"iteration": [5, 10], "lm_loss": [9.1, 8.2]}
    with pytest.raises(ValueError, match=r"different iterations \[10, 20\]"):
        lc.noise_band(base, 1234, {7: _records({5: 9.0, 20: 8.0}, 7.0)})


def test_smoothing_is_a_centred_mean():
    assert lc._smooth([0.0, 3.0, 6.0, 9.0], 3) == [1.5, 3.0, 6.0, 7.5]
    assert lc._smooth([1.0, 2.0], 1) == [1.0, 2.0]


def test_report_with_noise_band_renders_and_draws(tmp_path):
    curves = {"baseline": _records({5: 9.0, 10: 8.0, 15: 7.5}, 7.0),
              "SDP4Bit": _records({5: 9.0, 10: 7.95, 15: 7.45}, 6.98),
              "qW": _records({5: 9.2, 10: 8.3, 15: 7.9}, 7.4)}
    others = {1235: _records({5: 9.1, 10: 8.2, 15: 7.6}, 7.05),
              1236: _records({5: 8.9, 10: 7.9, 15: 7.4}, 6.95)}
    report = {"meta": {"command": "c", "example_run": "r", "date": "d", "seconds": {"qW": 3.0},
                       "machine": {"cpu": "x", "cores": 2, "python": "3", "torch": "t",
                                   "triton": "t", "megatron_core": "m"}, "load": [0.5, 1.5]},
              "results": lc.compare(curves, points=9), "note": "",
              "noise": lc.noise_band(curves["baseline"], 1234, others)}
    report = json.loads(json.dumps(report))  # as --from-json reads it back
    md = lc.write_report(report, tmp_path)
    assert "| SDP4Bit | 6.9800 | -0.0200 | -0.29% | 7.4500 | yes |" in md
    assert "| qW | 7.4000 | +0.4000 | +5.71% | 7.9000 | no |" in md
    assert "| 1235 | 7.0500 | +0.71% |" in md
    assert "Band: 6.9500 to 7.0500, a spread of 1.43%" in md
    assert "load average of the machine before and after the runs: 0.5, 1.5" in md
    assert png_size(tmp_path / "loss_curves.png") == (1080, 312)
    assert json.loads((tmp_path / "loss_curves.json").read_text()) == report
