"""Files and folders written whole or not at all (megatron/sdp4bit/atomic_files.py)."""

from __future__ import annotations

import errno
import os

import pytest

from megatron.sdp4bit import atomic_files


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "tracker.txt"
    atomic_files.write_text(str(path), "10\n")
    with pytest.raises(OSError, match="disk full"):
        with atomic_files.atomic_open(str(path), "w") as f:
            f.write("2")
            raise OSError(errno.ENOSPC, "disk full")
    assert path.read_text() == "10\n"
    assert sorted(os.listdir(tmp_path)) == ["tracker.txt"]
    atomic_files.write_text(str(path), "20\n")
    assert path.read_text() == "20\n" and sorted(os.listdir(tmp_path)) == ["tracker.txt"]


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    (tmp_path / "out.txt.tmp").symlink_to(outside)
    atomic_files.write_text(str(tmp_path / "out.txt"), "new")
    assert outside.read_text() == "mine" and (tmp_path / "out.txt").read_text() == "new"
    assert not os.path.lexists(tmp_path / "out.txt.tmp")


def test_replace_folder_swaps_whole_folders_and_keeps_the_old_one_on_failure(tmp_path,
                                                                            monkeypatch):
    dest, new = tmp_path / "out", tmp_path / "new"
    new.mkdir()
    (new / "a").write_text("1")
    atomic_files.replace_folder(str(new), str(dest))  # nothing there yet
    assert os.listdir(dest) == ["a"] and not new.exists()
    new.mkdir()
    (new / "b").write_text("2")
    atomic_files.replace_folder(str(new), str(dest))
    assert os.listdir(dest) == ["b"] and sorted(os.listdir(tmp_path)) == ["out"]
    new.mkdir()
    (new / "c").write_text("3")
    real = os.replace

    def failing(src, dst):
        if src == str(new):
            raise OSError(errno.EXDEV, "cross-device link")
        real(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", failing)
    with pytest.raises(OSError, match="cross-device"):
        atomic_files.replace_folder(str(new), str(dest))
    assert os.listdir(dest) == ["b"]  # the old folder was put back
    assert sorted(os.listdir(tmp_path)) == ["new", "out"]  # no folder left aside
