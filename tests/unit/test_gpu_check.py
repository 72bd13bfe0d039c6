"""The GPU check (dev/gpu_check.sh): its rehearsal on CPU runs every step's code, a step that
fails or runs out of time leaves the others' results and the report, the per-rank work it
times is the comm layer's, the kernel cases cover every branch, the report names the commit
of a copied tree only when it can know it, and the wheels' requirements are checked against
the interpreter.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check, gpu_overhead, gpu_report
from dev import cuda_checks
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
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert report["env"]["commit"].split()[0] == head  # a checkout: git's answer
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
                  "[--wheels DIR] | --stamp)"),
    (["--stamp", "--rehearse"], "dev/gpu_check.sh: --stamp takes no other argument"),
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


def test_the_kernels_step_runs_every_operation_of_the_checks():
    assert gpu_check.KERNELS == tuple(cuda_checks.CASES)


def test_the_trimmed_kernel_cases_still_cover_every_branch():
    """[Note: covering the kernels' branches with few cases] (dev/cuda_checks.py): tlq_sender
    runs every layout with every bit width and Hadamard setting, and every combination of
    the compile-time settings; tlq_receiver every (senders, Hadamard, dtype), and each
    scale-and-accumulate choice with every value of each of them."""
    sender = [c for c in cuda_checks.tlq_sender() if c["group"] == 128]
    layouts = {(c["blocks"], c["dests"], c["slices"]) for c in sender}
    assert len(layouts) == 5 and len(sender) == 30
    assert {((c["blocks"], c["dests"], c["slices"]), c["bits"], c["hadamard"]) for c in sender} \
        == set(itertools.product(layouts, (8, 4, 2), (32, 0)))
    assert {(c["bits"], c["hadamard"], c["stochastic"], c["dtype"]) for c in sender} == set(
        itertools.product((8, 4, 2), (32, 0), (True, False), (torch.float32, torch.bfloat16)))
    assert any(c["nonfinite"] for c in sender) and len(list(cuda_checks.tlq_sender())) == 32
    receiver = [c for c in cuda_checks.tlq_receiver() if c["bits"] == 4 and c["group"] == 128]
    assert {(c["n_in"], c["hadamard"], c["dtype"]) for c in receiver} == set(
        itertools.product((4, 1), (32, 0), cuda_checks.DTYPES))
    choices = {(c["scale"], c["accumulate"]) for c in receiver}
    assert len(choices) == 3
    for key, values in (("n_in", (4, 1)), ("hadamard", (32, 0)), ("dtype", cuda_checks.DTYPES)):
        assert {(c[key], (c["scale"], c["accumulate"])) for c in receiver} == set(
            itertools.product(values, choices)), key
    assert {c["bits"] for c in cuda_checks.tlq_receiver()} == {4, 2, 8}


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_a_copied_tree_names_its_commit_only_from_a_stamp_that_matches_it(tmp_path):
    """[Note: the commit of a copied tree] (benchmarks/gpu_check.py)."""
    repo = tmp_path / "repo"
    (repo / "dev").mkdir(parents=True)
    (repo / "a.py").write_text("a = 1\n")
    (repo / "dev" / "b.txt").write_bytes(b"\x00\x01 binary\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    assert gpu_check.project_commit(repo) == head  # a checkout: git answers
    stamp = gpu_check.write_stamp(repo)
    assert stamp == dict(commit=head, dirty=False, files={
        "a.py": _git(repo, "hash-object", "a.py"),
        "dev/b.txt": _git(repo, "hash-object", "dev/b.txt")})
    assert gpu_check.project_commit(repo) == head  # the stamp is not dirt in git's eyes

    def copy(name: str) -> Path:  # what the GPU machine gets: the tree, no .git
        return Path(shutil.copytree(repo, tmp_path / name,
                                    ignore=shutil.ignore_patterns(".git")))

    assert gpu_check.project_commit(copy("copy")) == head
    changed = copy("changed")
    (changed / "a.py").write_text("a = 2\n")  # a stamp from another tree: not believed
    assert gpu_check.project_commit(changed) is None
    missing = copy("missing")
    (missing / "dev" / "b.txt").unlink()
    assert gpu_check.project_commit(missing) is None
    (repo / "new.py").write_text("")  # an untracked file travels with the copy too
    assert gpu_check.project_commit(repo) == head + " (with uncommitted changes)"
    (repo / "a.py").write_text("a = 3\n")  # the stamp holds the tree's bytes, not the commit's
    gpu_check.write_stamp(repo)
    assert gpu_check.project_commit(copy("dirty")) == head + " (with uncommitted changes)"
    (repo / gpu_check.STAMP).unlink()
    assert gpu_check.project_commit(copy("unstamped")) is None
    with pytest.raises(SystemExit, match="is not a git checkout"):
        gpu_check.write_stamp(tmp_path / "unstamped")


def test_the_stamp_travels_with_the_tree():
    """The borrowed machine gets tracked files and untracked ones that git does not ignore:
    the stamp must be one of those (dev/gpu_check.md)."""
    ignored = subprocess.run(["git", "check-ignore", "-q", gpu_check.STAMP], cwd=ROOT)
    assert ignored.returncode == 1


def test_the_report_says_unknown_for_an_unknown_commit(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps(dict(commit=None, device="x")))
    md = gpu_report.render(gpu_report.build(tmp_path, rehearsal=False))
    assert "- commit: unknown; date: None" in md
