"""The GPU check (dev/gpu_check.sh): its rehearsal on CPU runs every step's code, a step that
fails or runs out of time leaves the others' results and the report, the per-rank work it
times is the comm layer's, and the wheels' requirements are checked against the interpreter.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check, gpu_overhead, gpu_report
from megatron.sdp4bit.comm.padding import required_divisor

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "dev" / "gpu_check.sh"


def _run(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "OUT"}
    full.update(PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


def _steps(results: Path) -> dict[str, int]:
    return {s["step"]: s["exit"] for s in gpu_report._steps(results)}


@pytest.mark.slow  # one process per step and a training run: about 70 s on 2 loaded cores
def test_rehearsal_runs_every_step(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = _run("--rehearse", "--results", str(tmp_path / "res"), env={"OUT": str(out)})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    res = tmp_path / "res"
    assert _steps(res) == dict(install=0, env=0, kernels=0, bandwidth=0, overhead=0,
                               gpu_tests=0)
    report = json.loads((res / "gpu.json").read_text())
    assert report["env"]["rehearsal"] is True and report["env"]["megatron_core"]
    kernels = report["kernels"]["ops"]
    assert [k["op"] for k in kernels] == ["qwd_sender", "qwd_receiver", "tlq_sender",
                                          "tlq_middle", "tlq_receiver"]
    assert all(k["cases"] == 1 and k["failures"] == 0 for k in kernels)
    # every operation timed on both backends, the copy once
    bw = report["bandwidth"]
    ops = {(r["op"], r["backend"]) for r in bw["rows"]}
    assert len(bw["rows"]) == 15 and ("copy (fp32)", "-") in ops
    assert {b for _, b in ops} == {"-", "triton", "torch"} and bw["copy_gb_per_s"] > 0
    over = report["overhead"]
    assert over["baseline"]["parameters"] > 0 and over["baseline"]["step_ms"] > 0
    one_hop, two_hops = over["dp"]
    assert list(one_hop["phases_ms"]) == ["qwd_sender", "qwd_receiver", "tlq_sender",
                                          "tlq_receiver"]
    assert list(two_hops["phases_ms"]) == ["qwd_sender", "qwd_receiver", "tlq_sender",
                                           "tlq_middle (x8)", "tlq_receiver (x8)"]
    for row in over["dp"]:
        assert row["percent_of_step"] == pytest.approx(
            100 * row["total_ms"] / over["baseline"]["step_ms"], rel=1e-3)
    assert report["gpu_tests"]["skipped"] == 1  # no CUDA here
    md = (res / "gpu.md").read_text()
    assert md.startswith("# GPU check\n\n**REHEARSAL on CPU**")
    assert "| 16 | 8 x 2 |" in md and "out of time" not in md
    assert sorted(p.name for p in out.iterdir()) == ["baseline_train.log", "gpu.json",
                                                     "gpu.md", "gpu_check.log"]


def test_out_of_time_steps_are_recorded_and_the_report_still_comes(tmp_path):
    """With 16 s in all (15 kept for the report) the env step gets 1 s and is killed, the
    rest get none; the report says so, and the exit status is not 0."""
    done = _run("--rehearse", "--results", str(tmp_path), env={"GPU_CHECK_SECONDS": "16"},
                timeout=120)
    assert done.returncode == 1
    steps = _steps(tmp_path)
    assert steps == dict(install=0, env=124, kernels=124, bandwidth=124, overhead=124,
                         gpu_tests=124)
    md = (tmp_path / "gpu.md").read_text()
    assert "| kernels | 124 (out of time) | 0 | 0 |" in md
    assert md.count("Not measured (the step failed or ran out of time") == 3
    assert "== kernels: skipped, no time left" in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "dev/gpu_check.sh: unknown argument '--bogus' (usage: bash "
                  "dev/gpu_check.sh [--rehearse] [--write-results] [--results DIR] "
                  "[--wheels DIR])"),
    (["--rehearse", "--write-results"], "dev/gpu_check.sh: --write-results takes a GPU run's "
                                        "figures, not a rehearsal's"),
    (["--results"], "dev/gpu_check.sh: --results needs a folder"),
])
def test_bad_arguments_are_refused_in_one_line(args, message):
    done = _run(*args, timeout=30)
    assert done.returncode == 2 and done.stderr.strip() == message and done.stdout == ""


def test_a_total_that_is_not_whole_seconds_is_refused():
    done = _run("--rehearse", env={"GPU_CHECK_SECONDS": "5m"}, timeout=30)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("dev/gpu_check.sh: GPU_CHECK_SECONDS='5m' is not a whole "
                                   "number of seconds")


def test_without_cuda_the_gpu_steps_refuse_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^no CUDA device: run on a GPU machine, or rehearse "
                                         "on this one with --rehearse$"):
        gpu_check.main(["bandwidth", "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="set TRITON_INTERPRET=1"):
        gpu_check.main(["kernels", "--results", str(tmp_path), "--rehearse"])


@pytest.mark.parametrize("dp", [8, 16, 128])
def test_rank_work_is_what_the_comm_layer_issues(dp):
    """Buffers sized by the comm layer's rules for the speed scripts' settings, and every phase
    runs (torch references, the smallest bucket the DP size allows)."""
    sizes, phases = gpu_overhead.rank_work(1, dp, torch.device("cpu"), "torch")
    grads, weights = gpu_overhead.configs("torch")
    divisor = required_divisor(dp, **weights.divisor_kwargs(), **grads.divisor_kwargs())
    assert sizes["bucket"] == divisor and sizes["shard"] == divisor // dp
    assert (sizes["ranks_per_node"], sizes["nodes"]) == (8, dp // 8)
    hops = [(h["name"], h["peers"], h["collectives"]) for h in sizes["hops"]]
    assert hops == ([("intra", 8, 1)] if dp == 8 else
                    [("intra", 8, 8), ("inter", dp // 8, 8)])
    for _, run in phases:
        run()


def test_wheel_requirements_are_checked_against_this_interpreter(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n"
                   "Requires-Dist: torch>=2.0\nRequires-Dist: torch>=999\n"
                   "Requires-Dist: not-a-package-xyz\n"
                   "Requires-Dist: wandb; extra == \"mlm\"\n")
    rows = gpu_check.wheel_requirements([wheel])
    assert [(r["requires"], r["ok"]) for r in rows] == [
        ("torch>=2.0", True), ("torch>=999", False), ("not-a-package-xyz", False)]
    assert rows[0]["installed"] is not None and rows[2]["installed"] is None
