"""Checkpoint files: checksummed atomic writes, verified reads, tracker, run lock, claims.

No processes: these are the pieces the collective save/load are made of (the end-to-end
tests in tests/e2e/test_faults.py run them under torchrun).
"""

from __future__ import annotations

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
    with pytest.raises(cf.CheckpointError, match="is corrupt or not a checkpoint"):
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
