"""The files of a checkpoint folder: tracker, manifest, checksummed writes, the run lock
(written whole or not at all by ``megatron/sdp4bit/atomic_files.py``).

Layout under ``--save`` (Megatron-LM's tracker name)::

    latest_checkpointed_iteration.txt   the last complete iteration, replaced last
    .lock                               held by the run writing here (pid and host inside)
    iter_0000100/rank_00003.pt          every rank: its model chunk, optimizer shard, RNG
    iter_0000100/common.pt              rank 0: iteration, samples, schedule
    iter_0000100/manifest.json          rank 0, after every rank file: the SHA-256 and size
                                        of each file, and the run's layout, model shape and
                                        SDP4Bit settings

[Note: what survives a crash]
Each file is written to ``<name>.tmp`` and renamed when complete; the manifest is written
once every rank's file is complete, and the tracker is replaced only after that. A run
killed at any point leaves the tracker on the previous complete checkpoint, which loads.
On load, every file is checked against the manifest's SHA-256 before it is unpickled (with
``weights_only=True``: tensors and plain containers only), so a changed bit is reported with
the file's name instead of being trained on.

[Note: the manifest's own SHA-256]
The manifest records the SHA-256 of its own contents (``sha256``: canonical JSON of the rest,
:func:`manifest_digest`), so its settings (the layout, the model, the tokenizer record a Hugging
Face export ships from) and its file list are checked like the files: a manifest whose
contents changed after its save is refused as damaged. It seals the manifest against damage
and careless edits, not against its author, who can recompute it: what keeps an authored
checkpoint harmless is the rest (the restricted unpicklers, the checks of every ``.metadata``
entry, the tokenizer record's own SHA-256s). A manifest of an earlier release has no
``sha256``: it is read as before, with a note (:func:`unsealed_note`); so checkpoints of the
previous release still resume and export. Its file names must be plain names of its folder.

[Note: nothing outside --save is written]
The lock is opened with ``O_NOFOLLOW | O_CREAT`` and every other file is written under a
fresh temporary name (``O_EXCL | O_NOFOLLOW``, a stale one removed first) and renamed: a
symbolic link planted at ``.lock``, at the tracker or at a ``.tmp`` name is never written
through (the lock and the tracker refuse one with a line naming it). A checkpoint is read
only when ``--load``, its tracker and every file of the checkpoint folder keep the trust
rule of ``megatron/sdp4bit/trusted_paths.py`` (:func:`check_trusted`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
from typing import Any

import torch

from megatron.sdp4bit import atomic_files, trusted_paths
from megatron.sdp4bit.training.checkpoint import integrity, safe_load

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
LOCK = ".lock"
FORMAT = 1
PARTIAL = ".partial"  # the suffix of a torch_dist save's folder until it is published
INTERRUPTED = "interrupted_saves"  # where a first save's leftovers are moved aside


class CheckpointError(ValueError):
    """A missing, incomplete, corrupt or mismatched checkpoint; one line with the fix."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


class _HashingWriter:
    """File-like object for ``torch.save``: writes through and hashes what it writes."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save reports a failed write as RuntimeError

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self._f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._f.flush()


@contextlib.contextmanager
def _atomic(path: str, mode: str):
    """:func:`megatron.sdp4bit.atomic_files.atomic_open`, a failed write (a full disk, a lost
    mount) raised as :class:`CheckpointError` naming ``path``."""
    try:
        with atomic_files.atomic_open(path, mode) as f:
            yield f
    except OSError as err:
        raise CheckpointError(f"cannot write {path} ({err.strerror or err}): free space or "
                              "fix the folder; the last complete checkpoint stays current"
                              ) from None


def make_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create {path} ({err.strerror}): free space or fix the "
                              "folder; the last complete checkpoint stays current") from None


def save_file(obj: Any, path: str) -> dict[str, Any]:
    """``torch.save`` to ``path`` atomically (temporary name, fsync, rename); returns the
    manifest entry ``{"sha256", "bytes"}``."""
    with _atomic(path, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None  # the disk's error, named by _atomic
            raise
    return {"sha256": writer.sha256.hexdigest(), "bytes": writer.size}


def write_text_atomic(path: str, text: str) -> None:
    with _atomic(path, "w") as f:
        f.write(text)


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The SHA-256 of a manifest's contents but its own ``sha256`` (canonical JSON): what
    seals its settings and file list ([Note: the manifest's own SHA-256])."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def write_manifest(directory: str, iteration: int, files: dict[str, dict],
                   settings: dict[str, Any]) -> None:
    manifest = {"format": FORMAT, "iteration": iteration, "files": files, "settings": settings}
    manifest["sha256"] = manifest_digest(manifest)
    write_text_atomic(os.path.join(directory, MANIFEST),
                      json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _check_manifest(manifest: Any) -> None:
    """Raise ValueError unless ``manifest`` has every part a load reads, of the right type."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError("unknown format")
    for key, kind in (("iteration", int), ("files", dict), ("settings", dict)):
        if not isinstance(manifest.get(key), kind):
            raise ValueError(f"no {key!r} {kind.__name__}")
    if not isinstance(manifest.get("sha256", ""), str):
        raise ValueError("its sha256 is not a string")
    for name, entry in manifest["files"].items():
        if name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name:
            raise ValueError(f"entry {name!r} is not a file name of its folder")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("bytes"), int)):
            raise ValueError(f"entry {name!r} lacks sha256/bytes")


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The manifest, or None when the folder has none (refused by the load unless asked
    for: see :mod:`.torch_format`)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        _check_manifest(manifest)
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = getattr(err, "strerror", None) or err
        raise CheckpointError(f"{path} is unreadable or not a checkpoint manifest ({reason}): "
                              "the checkpoint is damaged; load an earlier one") from None
    if "sha256" in manifest and manifest["sha256"] != manifest_digest(manifest):
        raise CheckpointError(f"{path} does not match its own SHA-256: its settings or file "
                              "list changed after it was written; the checkpoint is damaged; "
                              "load an earlier one")
    return manifest


def unsealed_note(directory: str, manifest: dict[str, Any] | None) -> str | None:
    """The note for a manifest written before manifests recorded their own SHA-256 (an
    earlier release's), or None."""
    if manifest is None or "sha256" in manifest:
        return None
    return (f"{os.path.join(directory, MANIFEST)} was written by an earlier release, without "
            "its own SHA-256: its settings are read unchecked (its files are checked as "
            "before); the checkpoints this run saves record it")


def read_verified(path: str, entry: dict[str, Any] | None) -> dict[str, Any]:
    """Read ``path``, check it against its manifest entry (when there is one), unpickle it
    with ``weights_only=True``. Raises :class:`CheckpointError` naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is "
                              "incomplete or was written by a different number of ranks")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint file {path} ({err.strerror}): fix its "
                              "permissions or load an earlier checkpoint") from None
    problem = None if entry is None else integrity.check_bytes(path, data, entry)
    if problem is not None:
        raise CheckpointError(problem)
    try:
        return safe_load.torch_load(data, path)
    except safe_load.UnsafePickle as err:
        raise CheckpointError(str(err)) from None


def iteration_folders(root: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    except OSError:
        return []


def latest_iteration(root: str) -> int | None:
    """The iteration named by the tracker file; None when ``root`` holds no checkpoint.
    ``iter_*`` folders without a tracker, or a tracker that is not a file, are refused: a
    run would otherwise start from scratch and overwrite them."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.lexists(tracker):
        # a save's unpublished folder is no checkpoint (set_aside_interrupted_saves)
        found = [n for n in iteration_folders(root) if not n.endswith(PARTIAL)]
        if found:
            raise CheckpointError(f"{root} holds checkpoint folders ({', '.join(found[-3:])}) "
                                  f"but no {TRACKER}: write the iteration to resume into it "
                                  "(e.g. the number of the last complete iter_* folder), or "
                                  "choose another folder")
        return None
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{tracker} is not a file: delete it and write the iteration to "
                              "resume into it (the iter_* folders beside it hold the "
                              "checkpoints)")
    try:
        with open(tracker, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
    except OSError as err:
        raise CheckpointError(f"cannot read {tracker} ({err.strerror}): fix its "
                              "permissions") from None
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number: fix or "
                              "delete it (the iter_* folders beside it hold the checkpoints)")
    return int(text)


def set_aside_interrupted_saves(root: str) -> str | None:
    """Move ``iter_*.partial`` folders of ``root`` into ``root/interrupted_saves/`` when they
    are all it holds (no tracker, no other ``iter_*``): what a run stopped during its first
    save leaves ([Note: a first save that never finished]). Returns the line saying so, or
    None when there was nothing to move. Rank 0, holding ``root``'s lock.

    [Note: a first save that never finished]
    Until it is published, a torch_dist save is only ``iter_N.partial/`` (an asynchronous
    one until its finalize step), and the tracker is written last. A run stopped before its
    first save was published leaves that folder and no tracker: there is no checkpoint to
    resume, so a restart on the same ``--save`` (``--load`` too, or not) starts from scratch,
    as the user expects. The folder is moved aside, not deleted (it may be large, and it is
    the user's to inspect or delete), into a folder whose name does not start with
    ``iter_``, so that nothing counts it as a checkpoint; one line says where. An older
    leftover of the same iteration there is replaced. ``iter_*`` folders that are not
    partial without a tracker are still refused (:func:`latest_iteration`): those may be
    complete checkpoints whose tracker was lost.
    """
    if os.path.lexists(os.path.join(root, TRACKER)):
        return None
    found = iteration_folders(root)
    if not found or not all(name.endswith(PARTIAL) for name in found):
        return None
    aside = os.path.join(root, INTERRUPTED)
    try:
        os.makedirs(aside, exist_ok=True)
        for name in found:
            target = os.path.join(aside, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(root, name), target)
    except OSError as err:
        raise CheckpointError(f"cannot move {', '.join(found)} of {root} into {aside} "
                              f"({err.strerror}): fix the folder's permissions, or delete "
                              "them (a save that never finished: no checkpoint)") from None
    return (f"note: {root} held no checkpoint, only {', '.join(found)} of a save that never "
            f"finished (the run was stopped before publishing it): moved into {aside}/ "
            "(delete it to free its space); this run starts from scratch")


def newest_complete(root: str, exclude: int | None = None) -> int | None:
    """The newest iteration under ``root`` (``exclude`` aside) whose folder has a readable
    manifest and every file it lists at its size (checksums are left to the load)."""
    for name in reversed(iteration_folders(root)):
        if not name[5:].isdigit() or int(name[5:]) == exclude:
            continue
        directory = os.path.join(root, name)
        try:
            manifest = read_manifest(directory)
        except CheckpointError:
            continue
        if manifest is not None and all(
                os.path.isfile(p := os.path.join(directory, f)) and os.path.getsize(p) == e["bytes"]
                for f, e in manifest["files"].items()):
            return int(name[5:])
    return None


def write_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER)
    try:
        trusted_paths.refuse_link(path, "the tracker")
    except trusted_paths.UntrustedPathError as err:
        raise CheckpointError(str(err)) from None
    write_text_atomic(path, f"{iteration}\n")


def check_trusted(root: str, directory: str | None = None) -> None:
    """``root`` (the ``--load`` folder) and its tracker, and with ``directory`` that checkpoint
    folder and every file in it, keep the trust rule (``megatron/sdp4bit/trusted_paths.py``);
    else :class:`CheckpointError` naming the first path that does not."""
    fix = "copy the checkpoint into a folder of yours that only you can write"
    try:
        trusted_paths.check(root, "--load", fix)
        trusted_paths.check(os.path.join(root, TRACKER), "the tracker", fix)
        if directory is not None and os.path.isdir(directory):
            trusted_paths.check_tree(directory, "checkpoint", fix)
    except trusted_paths.UntrustedPathError as err:
        raise CheckpointError(str(err)) from None


class SaveDirLock:
    """An exclusive lock on a ``--save`` folder for the life of the run (``flock`` on
    ``.lock``, which records the holder's pid and host)."""

    def __init__(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, LOCK)
        try:  # never through a link: it would truncate a file outside --save
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if os.path.islink(self.path):
                raise CheckpointError(
                    f"{self.path} is a symbolic link (to {os.readlink(self.path)}): refused, "
                    "the lock's write would follow it out of --save; delete the link"
                    ) from None
            raise CheckpointError(f"cannot open {self.path} ({err.strerror}): fix --save "
                                  f"{root}'s permissions or choose another --save") from None
        self._f = open(fd, "r+", encoding="utf-8")
        found = trusted_paths.stat_problem(os.fstat(fd))
        if found is not None:
            self._f.close()
            raise CheckpointError(f"{self.path} {found}: refused, another user could hold "
                                  "or change it; delete it")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "unknown"
            self._f.close()
            raise CheckpointError(f"--save {root} is in use by another run ({holder}): wait "
                                  "for it to end or choose another --save") from None
        except OSError as err:  # e.g. a file system without locks (some NFS mounts)
            self._f.close()
            raise CheckpointError(f"cannot lock {self.path} ({err.strerror}): --save {root} "
                                  "must be on a file system with flock; choose another "
                                  "--save") from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        self._f.flush()

    def release(self) -> None:
        if not self._f.closed:
            fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()


def claim_save_dir(root: str, *, resuming_here: bool, overwrite: bool) -> SaveDirLock:
    """Lock ``root`` for this run; refuse a folder holding another run's checkpoints unless
    this run resumes from it (``--load`` the same folder) or ``overwrite`` (which deletes
    them first)."""
    lock = SaveDirLock(root)
    try:
        latest = latest_iteration(root)
    except CheckpointError:
        latest = -1  # a damaged tracker still means someone's checkpoints live here
    if latest is not None and not resuming_here:
        if not overwrite:
            lock.release()
            what = f"checkpoints up to iteration {latest}" if latest >= 0 else "checkpoints"
            raise CheckpointError(f"--save {root} already holds {what} of another run: resume "
                                  f"it with --load {root}, choose another --save, or pass "
                                  "--overwrite-checkpoints to delete them")
        tracker = os.path.join(root, TRACKER)
        if os.path.isdir(tracker) and not os.path.islink(tracker):
            shutil.rmtree(tracker, ignore_errors=True)
        elif os.path.lexists(tracker):
            os.remove(tracker)
        for name in os.listdir(root):
            if name.startswith("iter_"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return lock
