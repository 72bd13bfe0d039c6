"""A full disk during a save: checked before anything is written (training/checkpoint/
disk_space.py, [Note: a full disk during a save]).

``--save`` on a small tmpfs holds the iteration-2 checkpoint of the tiny GPT (about 2 MiB)
but not a second one, in either format: the save of iteration 4 stops every rank with one
line naming the folder and the space, no partial folder is left on the disk, the tracker
stays on iteration 2 and that checkpoint loads. And a disk that fills during the save, after
the check. Mounting needs root (as every run of this suite has here).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.helpers.trainer import TINY, launch, one_error_line, torchrun

pytestmark = pytest.mark.distributed

RUN = list(TINY)
for _flag, _value in (("--train-iters", "4"), ("--lr-warmup-iters", "1"),
                      ("--eval-interval", "100")):
    RUN[RUN.index(_flag) + 1] = _value


@pytest.mark.parametrize("ckpt_format, size", [
    ("torch_dist", "3m"),
    # this trainer's own per-rank format: no megatron-core path of its own
    pytest.param("torch", "4m", marks=pytest.mark.release_independent)])
def test_a_save_that_does_not_fit_stops_in_one_line_and_keeps_the_last(
        data_prefix, tmp_path, ckpt_format, size):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                   check=True)
    try:
        _check(data_prefix, disk / "ckpt", tmp_path / "copy", ckpt_format)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def _check(data_prefix, root, copy, ckpt_format: str) -> None:
    flags = RUN + data_prefix + ["--save", str(root), "--save-interval", "2",
                                 "--ckpt-format", ckpt_format]
    message = one_error_line(launch(flags, nproc=2))
    assert re.fullmatch(
        rf"not saving iteration 4: {re.escape(str(root))} has (\d+\.\d) MiB free, the "
        rf"checkpoint needs about (\d+\.\d) MiB; iteration 2 in {re.escape(str(root))} stays "
        r"the current checkpoint; free space on its file system \(or give --save another "
        r"folder\) and resume", message), message
    free, needed = map(float, re.search(r"has (\S+) MiB free.*about (\S+) MiB", message).groups())
    written = sum(os.path.getsize(os.path.join(d, f))
                  for d, _, names in os.walk(root / "iter_0000002") for f in names) / 2**20
    assert free < needed and written <= needed <= 1.2 * written + 1.1, (written, needed)
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"]
    if ckpt_format == "torch":
        return  # the per-rank format's files are complete and renamed before the manifest
    shutil.copytree(root, copy)  # the kept checkpoint loads (on a disk with room)
    res = torchrun(flags[:flags.index("--save")] + ["--load", str(copy), "--ckpt-format",
                                                    ckpt_format], nproc=2)
    assert f"loaded checkpoint from {copy} at iteration 2" in res.stdout


def test_a_disk_that_fills_during_the_save_stops_in_one_line_and_keeps_the_last(
        data_prefix, tmp_path):
    """The space check passed, then the disk filled (``fill-disk-saving``: another job):
    megatron-core's writes fail, every rank stops with one line, the partial folder goes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    try:
        root = disk / "ckpt"
        flags = RUN + data_prefix + ["--save", str(root), "--save-interval", "2"]
        message = one_error_line(launch(flags, nproc=2,
                                        env={"SDP4BIT_FAULT": "fill-disk-saving@4:0"}))
        # the errno where megatron-core's error carries it (0.16), else the space measured
        assert re.fullmatch(
            rf"saving iteration 4 to {re.escape(str(root))} failed \((No space left on device|"
            r"its file system is full: 0\.\d MiB free)\): its partial folder is removed and "
            rf"iteration 2 in {re.escape(str(root))} stays the current checkpoint; free space "
            r"on its file system \(or give --save another folder\) and resume", message), message
        assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
            "iter_0000002", "latest_checkpointed_iteration.txt"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
