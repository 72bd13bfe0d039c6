"""torch_dist checkpoints between the two tested megatron-core releases (0.16.1 and 0.19.2).

The project's two environments (``.venv`` and ``.venv-mcore019``, side by side, made by
``dev/run_tests.sh``) each run one tiny 2-rank job that saves:

* 0.16.1 trains 4 iterations, saving at 2 and 4; 0.19.2 resumes its iteration 2
  (``--ckpt-step 2``) and must log the same losses at 3 and 4, bit for bit (the same weights,
  samples and operations; ``--metrics-jsonl`` keeps every bit of the fp32 loss);
* that 0.19.2 run saves its iteration 4; 0.16.1 must refuse that checkpoint in one line
  naming both releases (it cannot read it: no ``common.pt``), before reading anything of it.

Both manifests record the release that wrote them. The test runs both releases itself, so
it is marked release_independent (run once per suite, not in both passes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.trainer import ROOT, TINY, launch, one_error_line, trainer_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.release_independent]

OLD, NEW = "0.16.1", "0.19.2"
FLAGS = [*TINY, "--global-batch-size", "4", "--log-interval", "1", "--eval-interval", "100",
         "--eval-iters", "1"]


def _interpreters() -> dict[str, str]:
    """{release: python} of the two environments beside this interpreter's."""
    base = Path(sys.prefix).parent
    found = {}
    for venv in (".venv", ".venv-mcore019"):
        python = base / venv / "bin" / "python"
        if python.exists():
            # the installed distribution's version: no import of torch or megatron-core
            version = subprocess.run(
                [str(python), "-c", "import importlib.metadata as m; "
                 "print(m.version('megatron-core').split('+')[0])"], capture_output=True,
                text=True, timeout=120, env=trainer_env()).stdout.strip()
            found[version] = str(python)
    if set(found) != {OLD, NEW}:
        pytest.skip(f"needs the environments of megatron-core {OLD} and {NEW} in {base} "
                    f"(found {sorted(found)}): run dev/run_tests.sh once to create them")
    return found


def _run(python: str, args: list[str]) -> subprocess.CompletedProcess:
    if Path(python).parent.parent == Path(sys.prefix):  # this release: the forked ranks
        return launch([*FLAGS, *args], nproc=2)
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=trainer_env(), cwd=ROOT)


def _losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


def _release(checkpoint: Path) -> str:
    return json.loads((checkpoint / "manifest.json").read_text())["settings"]["megatron_core"]


def test_checkpoints_cross_releases_or_are_refused_naming_both(data_prefix, tmp_path):
    python = _interpreters()
    old_save, new_save = tmp_path / "old", tmp_path / "new"

    res = _run(python[OLD], data_prefix + ["--train-iters", "4", "--save", str(old_save),
                                           "--save-interval", "2", "--metrics-jsonl",
                                           str(tmp_path / "old.jsonl")])
    assert res.returncode == 0, res.stderr[-3000:]
    assert _release(old_save / "iter_0000002") == OLD
    # the same launch saves its own iteration 4 (one launch of 0.19.2: fresh interpreters)
    res = _run(python[NEW], data_prefix + ["--train-iters", "4", "--load", str(old_save),
                                           "--ckpt-step", "2", "--metrics-jsonl",
                                           str(tmp_path / "resumed.jsonl"), "--save",
                                           str(new_save), "--save-interval", "2"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded checkpoint from" in res.stdout and "at iteration 2" in res.stdout
    reference, resumed = _losses(tmp_path / "old.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [3, 4]
    assert resumed == {k: reference[k] for k in (3, 4)}  # bit for bit

    assert sorted(os.listdir(new_save)) == [".lock", "iter_0000004",
                                            "latest_checkpointed_iteration.txt"]
    assert _release(new_save / "iter_0000004") == NEW
    res = _run(python[OLD], data_prefix + ["--train-iters", "6", "--load", str(new_save)])
    assert one_error_line(res) == (
        f"checkpoint {new_save / 'iter_0000004'} was written by megatron-core {NEW}, and this "
        f"run has megatron-core {OLD}, which cannot read it: resume it with megatron-core "
        f"{NEW} (requirements.txt pins it for Python >= 3.12), or load a checkpoint written "
        f"by {OLD}")
