"""A full disk for the tests of what a tool or the trainer does when a write fails for want
of space: a small tmpfs mounted for the length of a ``with`` block."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def full_disk(parent: Path, kib: int = 64) -> Iterator[Path]:
    """``parent / "disk"``, a tmpfs of ``kib`` KiB, for the block; unmounted after it (lazily:
    a failed check may still hold a file open there). Mounting needs root: without it the
    test is skipped here, after the checks it made before."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    disk = parent / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(disk)],
                   check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
