"""What a checkpoint holds is not trusted for being the user's own file.

No code runs from a checkpoint's pickles: the trainer's resume, ``--finetune`` of a
manifest-less checkpoint and tools/checkpoint/export_hf.py on a torch_dist checkpoint whose
``.metadata`` is a crafted pickle (its manifest rewritten to match, as its author would).
Each stops with one line naming the file and the refused type, and the marker directory the
pickle would create never appears. The unpicklers themselves, on every kind of pickle a
checkpoint holds: tests/unit/training/checkpoint/test_safe_load.py."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil

import pytest

from tests.helpers import launch as _launch
from tests.helpers.trainer import ROOT, TINY, launch, one_error_line, torchrun, trainer_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUN = list(TINY)
for _flag, _value in (("--train-iters", "2"), ("--lr-warmup-iters", "1"),
                      ("--eval-interval", "100")):
    RUN[RUN.index(_flag) + 1] = _value
RUN += ["--ckpt-format", "torch_dist"]


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant_metadata(root, marker: str, *, manifest: bool) -> str:
    folder = os.path.join(root, "iter_0000002")
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(_Planted(marker), f)
    path = os.path.join(folder, "manifest.json")
    if not manifest:
        os.remove(path)
        return folder
    with open(path, encoding="utf-8") as f:
        written = json.load(f)
    data = open(os.path.join(folder, ".metadata"), "rb").read()
    written["files"][".metadata"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                     "bytes": len(data)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(written, f)
    return folder


@pytest.fixture(scope="module")
def saved(data_prefix, tmp_path_factory):
    """A 2-rank torch_dist checkpoint of the tests' corpus at iteration 2."""
    folder = tmp_path_factory.mktemp("saved")
    torchrun(RUN + data_prefix + ["--save", str(folder), "--save-interval", "2"], nproc=2)
    return folder


def _export(load, output, *extra: str):
    return _launch.python(os.path.join(ROOT, "tools", "checkpoint", "export_hf.py"),
                          ["--load", str(load), "--output", str(output), *extra],
                          env=trainer_env(), cwd=ROOT, timeout=300)


def test_a_crafted_metadata_runs_no_code_in_the_trainer_or_the_export(data_prefix, saved,
                                                                      tmp_path):
    marker = str(tmp_path / "MARKER")
    refused = ("holds a pickled posix.mkdir, which is not a type a checkpoint holds: refusing "
               "to read it (unpickling it would run code); take the checkpoint from a source "
               "you trust")

    resumed = tmp_path / "resumed"  # the author also wrote the manifest
    shutil.copytree(saved, resumed)
    folder = _plant_metadata(resumed, marker, manifest=True)
    message = one_error_line(launch(RUN + data_prefix + ["--load", str(resumed)], nproc=2))
    assert message == f"checkpoint file {folder}/.metadata {refused}"

    res = _export(resumed, tmp_path / "hf")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stderr == f"export_hf.py: error: checkpoint file {folder}/.metadata {refused}\n"
    assert not os.path.exists(tmp_path / "hf")

    foreign = tmp_path / "foreign"  # a manifest-less (Megatron-LM) checkpoint
    shutil.copytree(saved, foreign)
    folder = _plant_metadata(foreign, marker, manifest=False)
    # a model that does not fit: the shape check must not read the metadata first
    message = one_error_line(launch(RUN + data_prefix + ["--finetune", "--load", str(foreign),
                                                         "--ffn-hidden-size", "128"], nproc=2))
    assert message == f"checkpoint file {folder}/.metadata {refused}"
    assert not os.path.exists(marker)
