"""Whether a checkpoint's files are the ones its save wrote: SHA-256 and size of every file,
recorded in the manifest (``files.py`` writes and reads it) and checked before anything is
read back.

[Note: what the manifest's hashes catch]
A file that is missing, truncated, replaced or changed after its save (a disk or copy
error, a bit flip at rest) is refused with one line naming it and the fix, before it is
unpickled or handed to megatron-core: a changed bit is never trained on. The save hashes
what it wrote (the per-rank format while writing, ``files.save_file``; the ``torch_dist``
format after megatron-core's writer, every rank hashing every world-size-th file,
:func:`hash_shares`); the load checks the same way (:func:`verify_files`, collective, or
:func:`check_bytes` for a file read whole). ``tools/checkpoint/export_hf.py`` checks with
:func:`file_hash` too.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch.distributed as dist


def file_hash(path: str) -> dict[str, Any]:
    """SHA-256 and size of a file, read in blocks; the file is fsync'ed on the way."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": size}


def shared_listing(directory: str) -> list[str]:
    names: list = [sorted(os.listdir(directory)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def hash_shares(directory: str, names: list[str]) -> dict[str, dict]:
    """Collective: every rank hashes every world-size-th file; all ranks get all entries."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {n: file_hash(os.path.join(directory, n)) for n in names[rank::world]}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in part.items()}


def mismatch(path: str, got: dict[str, Any], entry: dict[str, Any]) -> str | None:
    """One line if ``got`` (``{"sha256", "bytes"}`` of ``path`` as it is now) is not the
    manifest's ``entry``; None if it is."""
    if got["bytes"] != entry["bytes"]:
        return (f"checkpoint file {path} is {got['bytes']} bytes, the manifest says "
                f"{entry['bytes']}: it is truncated or was replaced")
    if got["sha256"] != entry["sha256"]:
        return (f"checkpoint file {path} does not match its SHA-256 in the manifest: it "
                "changed after it was written (disk or copy error); load an earlier "
                "checkpoint")
    return None


def check_bytes(path: str, data: bytes, entry: dict[str, Any]) -> str | None:
    """:func:`mismatch` for a file read whole into ``data``."""
    return mismatch(path, {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)},
                    entry)


def verify_files(directory: str, manifest: dict[str, Any]) -> str | None:
    """Collective: every file of the manifest is present with its size and SHA-256 (each
    rank reads every world-size-th file); returns the first problem, on every rank."""
    names = sorted(manifest["files"])
    problem = None
    for name in names[dist.get_rank()::dist.get_world_size()]:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problem = (f"checkpoint file {path} is missing: the checkpoint is incomplete; "
                       "load an earlier one")
        else:
            problem = mismatch(path, file_hash(path), manifest["files"][name])
        if problem:
            break
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)
