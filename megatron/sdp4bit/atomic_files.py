"""Files and folders written whole or not at all: a reader finds the old version or the new
one, never a part of either, whatever point a crash or a full disk stops the writer at.

[Note: atomic by rename]
A file is written under ``<name>.tmp``, flushed and ``fsync``'ed, then renamed over
``<name>``; the folder is synced after the rename, so that the rename survives a power loss.
The temporary name is opened fresh (:func:`megatron.sdp4bit.trusted_paths.open_new`:
``O_CREAT | O_EXCL | O_NOFOLLOW``, a stale one removed first), so a symbolic link planted
there is never written through, and a rename replaces a link at ``<name>`` instead of
following it. A folder is built beside its destination and put in place by renames
(:func:`replace_folder`). A failed write removes what it left and raises the ``OSError``;
callers turn it into their own one-line error (the checkpoint files' ``CheckpointError``,
the tools' messages).

Used by the checkpoint files (``training/checkpoint/files.py``) and by the tools' outputs
(``tools/checkpoint/export_hf.py``, ``import_hf.py``, ``tools/prepare_default_data.py``).
Like ``trusted_paths.py``, it imports nothing from the rest of the package but that module:
every layer and every tool may use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

from megatron.sdp4bit import trusted_paths

__all__ = ["atomic_open", "fsync_dir", "replace_folder", "write_text"]


def fsync_dir(directory: str) -> None:
    """Sync a folder's entries, so that a rename in it survives a power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str, mode: str) -> Iterator[IO]:
    """A file opened as ``<path>.tmp``, synced and renamed to ``path`` once written whole
    ([Note: atomic by rename]). An ``OSError`` on the way (a full disk, a lost mount)
    removes the temporary file and propagates; ``path`` keeps what it held."""
    tmp = path + ".tmp"
    try:
        fd = trusted_paths.open_new(tmp)  # never through a link planted at the .tmp name
        with open(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_text(path: str, text: str) -> None:
    """``text`` to ``path`` through :func:`atomic_open`."""
    with atomic_open(path, "w") as f:
        f.write(text)


def replace_folder(complete: str, dest: str) -> None:
    """Put the finished folder ``complete`` at ``dest`` by renames, replacing a folder there
    whole, never mixing the two: the old one is moved aside first and put back if the
    second rename fails. Both must be on one file system (``complete`` beside ``dest``). The
    tools' outputs (an export, an import, the default dataset's cache) end this way."""
    if not os.path.isdir(dest):
        os.replace(complete, dest)
        return
    aside = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(dest)),
                             prefix=f".{os.path.basename(os.path.abspath(dest))}.old-")
    try:
        os.replace(dest, os.path.join(aside, "previous"))
        try:
            os.replace(complete, dest)
        except OSError:
            os.replace(os.path.join(aside, "previous"), dest)  # the old folder stays
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
