"""Checkpoint files: checksummed atomic writes, verified reads, tracker, run lock, claims.

No processes: these are the pieces the collective save/load are made of (the end-to-end
tests in tests/e2e/test_faults.py run them under torchrun).
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from megatron.sdp4bit.training.checkpoint import files as cf


def _saved(tmp_path) -> tuple[str, dict]:
    path = str(tmp_path / "rank_00000.pt")
    entry = cf.save_file({"w": torch.arange(64, dtype=torch.float32), "n": 3}, path)
    return path, entry


def test_save_then_verified_read_round_trips(tmp_path):
    path, entry = _saved(tmp_path)
    assert entry["bytes"] == os.path.getsize(path) and len(entry["sha256"]) == 64
    assert not os.path.exists(path + ".tmp")
    state = cf.read_verified(path, entry)
    assert torch.equal(state["w"], torch.arange(64, dtype=torch.float32)) and state["n"] == 3


def test_a_flipped_bit_in_a_finite_value_is_reported(tmp_path):
    path, entry = _saved(tmp_path)
    data = bytearray(open(path, "rb").read())
    at = data.index(torch.tensor([17.0]).numpy().tobytes())  # inside the tensor's storage
    data[at] ^= 0x01  # 17.0 -> 17.000002: still a finite, loadable value
    open(path, "wb").write(bytes(data))
    assert torch.load(path, weights_only=True)["w"][17] != 17.0  # torch alone would load it
    with pytest.raises(cf.CheckpointError) as err:
        cf.read_verified(path, entry)
    assert str(err.value) == (f"checkpoint file {path} does not match its SHA-256 in the "
                              "manifest: it changed after it was written (disk or copy "
                              "error); load an earlier checkpoint")


def test_truncated_and_missing_files(tmp_path):
    path, entry = _saved(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(entry["bytes"] - 10)
    with pytest.raises(cf.CheckpointError, match=f"is {entry['bytes'] - 10} bytes, the "
                                                 f"manifest says {entry['bytes']}: it is "
                                                 "truncated"):
        cf.read_verified(path, entry)
    with pytest.raises(cf.CheckpointError, match="truncated"):
        cf.read_verified(path, None)  # no manifest: torch's own error, as one line
    os.remove(path)
    with pytest.raises(cf.CheckpointError, match="is missing: the checkpoint is incomplete"):
        cf.read_verified(path, entry)


def test_pickled_code_is_refused(tmp_path):
    class RunsCode:
        def __reduce__(self):
            return (open, (str(tmp_path / "code-ran"), "w"))

    path = str(tmp_path / "evil.pt")
    torch.save({"x": RunsCode()}, path)
    with pytest.raises(cf.CheckpointError, match="evil.pt holds a pickled io.open, which is "
                                                 "not a type a checkpoint holds: "):
        cf.read_verified(path, None)
    assert not (tmp_path / "code-ran").exists()


def test_tracker(tmp_path):
    root = str(tmp_path)
    assert cf.latest_iteration(root) is None
    cf.write_tracker(root, 120)
    assert cf.latest_iteration(root) == 120
    (tmp_path / cf.TRACKER).write_text("garbage\n")
    with pytest.raises(cf.CheckpointError, match="holds 'garbage', not an iteration number"):
        cf.latest_iteration(root)


def test_manifest(tmp_path):
    d = str(tmp_path)
    assert cf.read_manifest(d) is None  # a checkpoint from before manifests
    cf.write_manifest(d, 5, {"a.pt": {"sha256": "0" * 64, "bytes": 1}}, {"layout": {"dp": 2}})
    manifest = cf.read_manifest(d)
    assert manifest["iteration"] == 5 and manifest["settings"] == {"layout": {"dp": 2}}
    (tmp_path / cf.MANIFEST).write_text(json.dumps({"format": 99, "files": {}}))
    with pytest.raises(cf.CheckpointError, match="not a checkpoint manifest"):
        cf.read_manifest(d)


def test_the_manifests_settings_are_covered_by_its_own_sha256(tmp_path):
    """The settings (the tokenizer record a Hugging Face export ships from among them) were
    checked by nothing: a rewritten settings.tokenizer was read as written."""
    from tests.helpers import crafted

    d = str(tmp_path)
    tokenizer = {"type": "GPT2BPETokenizer", "sha256": {"/a/vocab.json": "1" * 64}}
    (tmp_path / "a.pt").write_bytes(b"a")
    cf.write_manifest(d, 5, {"a.pt": {"sha256": "0" * 64, "bytes": 1}},
                      {"layout": {"dp": 2}, "tokenizer": tokenizer})
    assert cf.read_manifest(d)["settings"]["tokenizer"] == tokenizer
    damaged = (f"{d}/{cf.MANIFEST} does not match its own SHA-256: its settings or file list "
               "changed after it was written; the checkpoint is damaged; load an earlier one")
    crafted.edit_settings(d, lambda s: s["tokenizer"].update(sha256={}), seal=False)
    with pytest.raises(cf.CheckpointError) as err:
        cf.read_manifest(d)
    assert str(err.value) == damaged
    crafted.reseal(d)  # its author can seal it again: the record's own checks refuse that
    assert cf.read_manifest(d)["settings"]["tokenizer"]["sha256"] == {}

    # a manifest of the previous release has no sha256 of its own: read, with a note
    manifest = json.loads((tmp_path / cf.MANIFEST).read_text())
    del manifest["sha256"]
    (tmp_path / cf.MANIFEST).write_text(json.dumps(manifest))
    assert cf.read_manifest(d)["iteration"] == 5
    assert cf.unsealed_note(d, cf.read_manifest(d)) == (
        f"{d}/{cf.MANIFEST} was written by an earlier release, without its own SHA-256: its "
        "settings are read unchecked (its files are checked as before); the checkpoints this "
        "run saves record it")
    cf.write_manifest(d, 5, {}, {})
    assert cf.unsealed_note(d, cf.read_manifest(d)) is None

    # file names are names of the folder: a hash check never opens a path outside it
    for name in ("../outside.pt", "/etc/passwd", ".."):
        cf.write_manifest(d, 5, {name: {"sha256": "0" * 64, "bytes": 1}}, {})
        with pytest.raises(cf.CheckpointError) as err:
            cf.read_manifest(d)
        assert str(err.value) == (f"{d}/{cf.MANIFEST} is unreadable or not a checkpoint "
                                  f"manifest (entry {name!r} is not a file name of its folder): "
                                  "the checkpoint is damaged; load an earlier one")


def test_one_run_per_save_folder(tmp_path):
    lock = cf.SaveDirLock(str(tmp_path))
    with pytest.raises(cf.CheckpointError) as err:
        cf.SaveDirLock(str(tmp_path))
    assert str(err.value) == (f"--save {tmp_path} is in use by another run (pid {os.getpid()} "
                              f"on host {os.uname().nodename}): wait for it to end or choose "
                              "another --save")
    lock.release()
    cf.SaveDirLock(str(tmp_path)).release()  # free again


def test_another_runs_checkpoints_are_refused_unless_resumed_or_overwritten(tmp_path):
    root = str(tmp_path)
    os.makedirs(cf.iteration_dir(root, 20))
    cf.write_tracker(root, 20)
    with pytest.raises(cf.CheckpointError) as err:
        cf.claim_save_dir(root, resuming_here=False, overwrite=False)
    assert str(err.value) == (f"--save {root} already holds checkpoints up to iteration 20 of "
                              f"another run: resume it with --load {root}, choose another "
                              "--save, or pass --overwrite-checkpoints to delete them")
    cf.claim_save_dir(root, resuming_here=True, overwrite=False).release()
    assert cf.latest_iteration(root) == 20  # resuming touches nothing
    cf.claim_save_dir(root, resuming_here=False, overwrite=True).release()
    assert cf.latest_iteration(root) is None
    assert not os.path.exists(cf.iteration_dir(root, 20))


def test_iteration_folders_without_a_tracker_are_not_overwritten(tmp_path):
    root = str(tmp_path)
    os.makedirs(cf.iteration_dir(root, 20))
    with pytest.raises(cf.CheckpointError) as err:
        cf.latest_iteration(root)
    assert str(err.value) == (f"{root} holds checkpoint folders (iter_0000020) but no "
                              f"{cf.TRACKER}: write the iteration to resume into it (e.g. the "
                              "number of the last complete iter_* folder), or choose another "
                              "folder")
    with pytest.raises(cf.CheckpointError, match="already holds checkpoints of another run"):
        cf.claim_save_dir(root, resuming_here=False, overwrite=False)
    assert os.path.isdir(cf.iteration_dir(root, 20))
    cf.claim_save_dir(root, resuming_here=False, overwrite=True).release()
    assert cf.latest_iteration(root) is None


def _claim(monkeypatch, root: str, load: str | None):
    """``build.claim_save_dir`` on rank 0 of a world of one."""
    from megatron.sdp4bit.training import build

    monkeypatch.setattr(build.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(build.dist, "broadcast_object_list", lambda objects, src: None)
    args = argparse.Namespace(save=root, load=load, overwrite_checkpoints=False)
    return build.claim_save_dir(args)


@pytest.mark.parametrize("load", [True, False], ids=["save-and-load", "save-only"])
def test_a_first_save_that_never_finished_is_moved_aside_and_the_run_starts_over(
        monkeypatch, capsys, tmp_path, load):
    """A run stopped during its first save leaves iter_N.partial and no tracker: the restart
    starts from scratch, the leftover moved aside with one line ([Note: a first save that
    never finished])."""
    root = str(tmp_path / "ckpt")
    leftover = cf.iteration_dir(root, 5) + ".partial"
    os.makedirs(leftover)
    with open(os.path.join(leftover, "__0_0.distcp"), "w") as f:
        f.write("half")
    assert cf.latest_iteration(root) is None  # no checkpoint, not a refusal
    _claim(monkeypatch, root, root if load else None).release()
    aside = os.path.join(root, cf.INTERRUPTED)
    assert capsys.readouterr().out == (
        f"note: {root} held no checkpoint, only iter_0000005.partial of a save that never "
        f"finished (the run was stopped before publishing it): moved into {aside}/ (delete it "
        "to free its space); this run starts from scratch\n")
    assert sorted(os.listdir(root)) == sorted([cf.LOCK, cf.INTERRUPTED])
    with open(os.path.join(aside, "iter_0000005.partial", "__0_0.distcp")) as f:
        assert f.read() == "half"  # moved, not deleted
    assert cf.latest_iteration(root) is None
    # the same crash again: the older leftover of that iteration is replaced
    os.makedirs(leftover)
    assert cf.set_aside_interrupted_saves(root) is not None
    assert os.listdir(os.path.join(aside, "iter_0000005.partial")) == []


def test_partial_folders_beside_a_checkpoint_are_left_to_the_next_save(tmp_path):
    root = str(tmp_path)
    os.makedirs(cf.iteration_dir(root, 5) + ".partial")
    os.makedirs(cf.iteration_dir(root, 4))
    # no tracker, but a folder that may be a complete checkpoint: refused, naming only it
    with pytest.raises(cf.CheckpointError, match=r"holds checkpoint folders \(iter_0000004\) "):
        cf.latest_iteration(root)
    assert cf.set_aside_interrupted_saves(root) is None
    cf.write_tracker(root, 4)  # a tracker: the partial folder is the next save's business
    assert cf.set_aside_interrupted_saves(root) is None and cf.latest_iteration(root) == 4
    assert os.path.isdir(cf.iteration_dir(root, 5) + ".partial")


def test_a_tracker_that_is_a_folder_is_refused(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, cf.TRACKER))
    with pytest.raises(cf.CheckpointError) as err:
        cf.latest_iteration(root)
    assert str(err.value) == (f"{root}/{cf.TRACKER} is not a file: delete it and write the "
                              "iteration to resume into it (the iter_* folders beside it hold "
                              "the checkpoints)")
    with pytest.raises(cf.CheckpointError, match="already holds checkpoints of another run"):
        cf.claim_save_dir(root, resuming_here=False, overwrite=False)
    cf.claim_save_dir(root, resuming_here=False, overwrite=True).release()
    assert cf.latest_iteration(root) is None


@pytest.mark.parametrize("drop", ["settings", "files", "iteration"])
def test_a_manifest_missing_a_part_is_one_line(tmp_path, drop):
    d = str(tmp_path)
    cf.write_manifest(d, 5, {"a.pt": {"sha256": "0" * 64, "bytes": 1}}, {"layout": {}})
    manifest = json.loads((tmp_path / cf.MANIFEST).read_text())
    del manifest[drop]
    (tmp_path / cf.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(cf.CheckpointError) as err:
        cf.read_manifest(d)
    assert str(err.value) == (f"{d}/{cf.MANIFEST} is unreadable or not a checkpoint manifest "
                              f"(no {drop!r} {'int' if drop == 'iteration' else 'dict'}): the "
                              "checkpoint is damaged; load an earlier one")


def test_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    class Full:
        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    write = cf._HashingWriter.write

    def fill_up(self, data):  # the disk fills after the first bytes
        if self.size > 100:
            self._f = Full()
        return write(self, data)

    monkeypatch.setattr(cf._HashingWriter, "write", fill_up)
    path = str(tmp_path / "rank_00000.pt")
    with pytest.raises(cf.CheckpointError) as err:
        cf.save_file({"w": torch.zeros(1000)}, path)
    assert str(err.value) == (f"cannot write {path} (No space left on device): free space or "
                              "fix the folder; the last complete checkpoint stays current")
    assert os.listdir(tmp_path) == []


def test_unreadable_files_and_unlockable_folders_are_one_line(tmp_path, monkeypatch):
    import errno
    import fcntl

    path, entry = _saved(tmp_path)
    real_open = open

    def no_permission(p, *a, **k):
        if p == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
        return real_open(p, *a, **k)

    monkeypatch.setattr("builtins.open", no_permission)
    with pytest.raises(cf.CheckpointError) as err:
        cf.read_verified(path, entry)
    assert str(err.value) == (f"cannot read checkpoint file {path} (Permission denied): fix its "
                              "permissions or load an earlier checkpoint")
    monkeypatch.undo()

    def no_locks(f, how):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(cf.CheckpointError) as err:
        cf.SaveDirLock(str(tmp_path))
    assert str(err.value) == (f"cannot lock {tmp_path}/.lock (No locks available): --save "
                              f"{tmp_path} must be on a file system with flock; choose another "
                              "--save")


def test_links_planted_in_the_save_folder_are_never_written_through(tmp_path):
    """A symbolic link at .lock, at the tracker or at a .tmp name: opening the lock with
    open(path, "a+") followed the link and truncated a file outside --save."""
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    save = tmp_path / "save"
    save.mkdir()
    (save / cf.LOCK).symlink_to(outside)
    with pytest.raises(cf.CheckpointError) as err:
        cf.SaveDirLock(str(save))
    assert str(err.value) == (f"{save / cf.LOCK} is a symbolic link (to {outside}): refused, "
                              "the lock's write would follow it out of --save; delete the link")
    (save / cf.LOCK).unlink()
    cf.SaveDirLock(str(save)).release()
    (save / cf.TRACKER).symlink_to(outside)
    with pytest.raises(cf.CheckpointError) as err:
        cf.write_tracker(str(save), 4)
    assert str(err.value) == (f"the tracker {save / cf.TRACKER} is a symbolic link (to "
                              f"{outside}): refused, a write would follow it out of its "
                              "folder; delete the link")
    (save / cf.TRACKER).unlink()
    (save / (cf.TRACKER + ".tmp")).symlink_to(outside)  # a stale temporary name
    cf.write_tracker(str(save), 4)
    manifest = save / "iter_0000004" / cf.MANIFEST
    manifest.parent.mkdir()
    (save / "iter_0000004" / (cf.MANIFEST + ".tmp")).symlink_to(outside)
    cf.write_manifest(str(manifest.parent), 4, {}, {})
    assert cf.latest_iteration(str(save)) == 4 and json.loads(manifest.read_text())["files"] == {}
    assert outside.read_text() == "keep me\n"
    assert not any(p.is_symlink() for p in save.rglob("*"))
