"""tools/quickstart.sh keeps every run: a new folder each time, RUN_DIR continues a run.

The script runs for real in a copy of the repository's tools with three stand-ins: a
``setup_env.sh`` that only activates this interpreter's environment, a
``prepare_default_data.py`` that prints data flags, and ``torchrun`` as an exported bash
function (it wins over PATH) that records its arguments and writes what the trainer would:
metrics lines appended, a checkpoint tracker. The summary and the picture are the real tools.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_TORCHRUN = r'''
torchrun() {
    printf '%s\n' "$*" >> "$QS_RECORD"
    local metrics="" save="" iters="" load="" prev=""
    for a in "$@"; do
        case "$prev" in
            --metrics-jsonl) metrics="$a" ;; --save) save="$a" ;;
            --train-iters) iters="$a" ;; --load) load="$a" ;;
        esac
        prev="$a"
    done
    local start=0
    [[ -f "$load/latest_checkpointed_iteration.txt" ]] && start=$(cat "$load/latest_checkpointed_iteration.txt")
    for ((it = start + 5; it <= iters; it += 5)); do
        printf '{"iteration": %d, "lm_loss": %s, "elapsed_ms": 50.0, "consumed_samples": %d, "consumed_tokens": %d, "comm_bytes_grads_inter": 10, "baseline_comm_bytes_grads_inter": 75}\n' \
            "$it" "$((100 - it)).5" "$((16 * it))" "$((2048 * it))" >> "$metrics"
    done
    mkdir -p "$save" && echo "$iters" > "$save/latest_checkpointed_iteration.txt"
    echo " iteration $iters/$iters | trained from $start"
}
export -f torchrun
'''


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    for name in ("quickstart.sh", "summarize_metrics.py", "plot_metrics.py"):
        shutil.copy(REPO / "tools" / name, root / "tools" / name)
    (root / "tools" / "setup_env.sh").write_text(
        f"source {Path(sys.executable).parent}/activate 2>/dev/null || "
        f"export PATH={Path(sys.executable).parent}:$PATH\n")
    (root / "tools" / "prepare_default_data.py").write_text(
        "print('--data-path'); print('data/cache/kjv_text_document')\n")
    (root / "fake_torchrun.sh").write_text(FAKE_TORCHRUN)
    return root


def quickstart(repo: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = f"source {repo / 'fake_torchrun.sh'} && bash {repo / 'tools' / 'quickstart.sh'}"
    full_env = dict(os.environ, QS_RECORD=str(repo / "torchrun.txt"), **env)
    full_env.pop("RUN_DIR", None)
    full_env.update(env)
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300,
                          env=full_env, cwd=repo)


def test_two_runs_keep_both_and_a_third_continues_the_first(repo):
    first, second = quickstart(repo), quickstart(repo)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    runs = sorted(p for p in (repo / "runs" / "quickstart").iterdir() if p.name != "latest")
    assert len(runs) == 2 and all(re.fullmatch(r"run-\d{8}-\d{6}(-x)*", p.name) for p in runs)
    for run in runs:
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in metrics] == list(range(5, 65, 5))
        assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "60\n"
        assert (run / "train.log").read_text().count("trained from 0") == 1
        assert (run / "metrics.png").stat().st_size > 10_000
    latest = repo / "runs" / "quickstart" / "latest"
    newest = repo / re.search(r"^continue it:  RUN_DIR=(\S+) ", second.stdout, re.M)[1]
    assert latest.is_symlink() and latest.resolve() == newest.resolve()
    # every phase is named as it starts, and timed at the end
    for k, text in enumerate(["setting up .venv", "preparing the default dataset",
                              "training into runs/quickstart/run-", "summary"], start=1):
        assert re.search(rf"^== \[{k}/4\] {re.escape(text)}", second.stdout, re.M), second.stdout
    assert re.search(r"^time: +\d+ s in all: setup \d+ s, data \d+ s, training \d+ s, "
                     r"summary \d+ s$", second.stdout, re.M), second.stdout
    assert "lm loss: 95.5000 at iteration 5 -> 40.5000 at iteration 60" in second.stdout

    kept = (runs[0] / "metrics.jsonl").read_text()
    rel = runs[0].relative_to(repo)
    assert f"continue it:  RUN_DIR={rel} TRAIN_ITERS=120 bash tools/quickstart.sh" in first.stdout
    third = quickstart(repo, RUN_DIR=str(rel), TRAIN_ITERS="120")
    assert third.returncode == 0, third.stderr
    assert f"training: continuing {rel} from iteration 60 to 120" in third.stdout
    last_call = (repo / "torchrun.txt").read_text().splitlines()[-1]
    assert f"--load {rel}/checkpoints" in last_call and "--train-iters 120" in last_call
    grown = (runs[0] / "metrics.jsonl").read_text()
    assert grown.startswith(kept)  # appended, nothing lost
    assert [json.loads(x)["iteration"] for x in grown.splitlines()] == list(range(5, 125, 5))
    assert "trained from 60" in (runs[0] / "train.log").read_text()
    assert latest.resolve() == runs[0].resolve()


def test_a_folder_with_a_run_but_no_checkpoint_is_refused(repo):
    crashed = repo / "runs" / "mine"
    crashed.mkdir(parents=True)
    (crashed / "metrics.jsonl").write_text('{"iteration": 5, "lm_loss": 9.0}\n')
    res = quickstart(repo, RUN_DIR="runs/mine")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "quickstart: RUN_DIR=runs/mine holds a run without a checkpoint to continue from; "
        "choose another RUN_DIR (or leave RUN_DIR unset for a new folder)"]
    assert (crashed / "metrics.jsonl").read_text() == '{"iteration": 5, "lm_loss": 9.0}\n'
    assert not (repo / "torchrun.txt").exists()


def test_a_continued_run_replays_the_first_runs_flags(repo):
    """The printed 'continue it:' command must train on the first run's data: its flags are
    recorded in the run folder and replayed (flags of the continuing command win)."""
    own = ["--data-path", "data/my text/mytext_text_document", "--seed", "7"]
    cmd = (f"source {repo / 'fake_torchrun.sh'} && bash {repo / 'tools' / 'quickstart.sh'} "
           + " ".join(f"'{a}'" for a in own))
    env = dict(os.environ, QS_RECORD=str(repo / "torchrun.txt"), RUN_DIR="runs/own")
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300,
                         env=env, cwd=repo)
    assert res.returncode == 0, res.stderr
    assert (repo / "runs" / "own" / "flags.txt").read_text().splitlines() == own
    cont = quickstart(repo, RUN_DIR="runs/own", TRAIN_ITERS="120")
    assert cont.returncode == 0, cont.stderr
    assert ("the first run's flags (from runs/own/flags.txt): --data-path data/my text/"
            "mytext_text_document --seed 7") in cont.stdout
    last_call = (repo / "torchrun.txt").read_text().splitlines()[-1]
    assert last_call.endswith("--save-interval 120 --data-path data/my text/mytext_text_document "
                              "--seed 7 --use-checkpoint-opt_param-scheduler"), last_call
    again = subprocess.run(["bash", "-c", cmd.replace("'--seed' '7'", "'--seed' '9'")],
                           capture_output=True, text=True, timeout=300,
                           env=dict(env, TRAIN_ITERS="180"), cwd=repo)
    assert again.returncode == 0, again.stderr
    last_call = (repo / "torchrun.txt").read_text().splitlines()[-1]
    assert "--seed 7 --data-path data/my text/mytext_text_document --seed 9 " in last_call
    assert (repo / "runs" / "own" / "flags.txt").read_text().splitlines() == own  # kept
