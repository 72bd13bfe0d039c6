"""The restricted unpicklers of training/checkpoint/safe_load.py on a small torch_dist folder
written by PyTorch Distributed Checkpoint itself: crafted pickles planted in ``.metadata``,
``common.pt``, an object inside a ``.distcp`` file and a per-rank file are refused in one
line naming the file and the type, and their code never runs (a marker file never appears).
The trainer's and the tools' runs on planted checkpoints are in
tests/e2e/test_checkpoint_pickles.py."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.sdp4bit.training.checkpoint import files, safe_load
from megatron.sdp4bit.training.checkpoint.files import CheckpointError
from megatron.sdp4bit.training.checkpoint.safe_load import UnsafePickle


class Planted:
    """What a crafted checkpoint holds: unpickling it creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _folder(path, objects: dict | None = None) -> str:
    """A torch_dist-like folder: tensors, a non-tensor object ("step"), common.pt."""
    folder = str(path)
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
             "step": 3, **(objects or {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    torch.save({"iteration": 3, "args": __import__("argparse").Namespace(lr=1.0)},
               os.path.join(folder, "common.pt"))
    return folder


def test_a_legitimate_folder_reads_through_the_restricted_unpicklers(tmp_path):
    metadata = safe_load.check_dist_checkpoint(_folder(tmp_path / "ok"))
    assert metadata.state_dict_metadata["w"].size == torch.Size([2, 3])
    assert metadata.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    # the tools' reader gives torch the same metadata
    reader = safe_load.safe_reader(str(tmp_path / "ok"))
    state = {"w": torch.empty(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3))


def test_planted_pickles_are_refused_in_one_line_and_never_run(tmp_path):
    marker = str(tmp_path / "MARKER")
    refused = "holds a pickled posix.mkdir, which is not a type a checkpoint holds"

    # .metadata: PyTorch Distributed Checkpoint's index (torch reads it with pickle.load)
    folder = _folder(tmp_path / "metadata")
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(Planted(marker), f)
    with pytest.raises(UnsafePickle) as err:
        safe_load.check_dist_checkpoint(folder)
    assert str(err.value).startswith(f"checkpoint file {folder}/.metadata {refused}")
    with pytest.raises(UnsafePickle):
        safe_load.safe_reader(folder).read_metadata()

    # common.pt (megatron-core 0.16's common state)
    folder = _folder(tmp_path / "common")
    torch.save({"iteration": Planted(marker)}, os.path.join(folder, "common.pt"))
    with pytest.raises(UnsafePickle) as err:
        safe_load.check_dist_checkpoint(folder)
    assert str(err.value).startswith(f"checkpoint file {folder}/common.pt {refused}")

    # a non-tensor object inside a .distcp file (torch loads those with weights_only=False)
    folder = _folder(tmp_path / "object", {"rng_state": Planted(marker)})
    with pytest.raises(UnsafePickle) as err:
        safe_load.check_dist_checkpoint(folder)
    assert str(err.value).startswith(f"checkpoint file {folder}/__0_0.distcp (object "
                                      f"rng_state) {refused}"), str(err.value)

    # a per-rank (--ckpt-format torch) file, its manifest entry rewritten by its author
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"model": Planted(marker)}, path)
    data = open(path, "rb").read()
    entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with pytest.raises(CheckpointError) as err:
        files.read_verified(path, entry)
    assert str(err.value).startswith(f"checkpoint file {path} {refused}")

    assert not os.path.exists(marker)


def test_a_metadata_naming_a_file_outside_its_folder_is_refused(tmp_path):
    folder = _folder(tmp_path / "escape")
    metadata = safe_load.read_dcp_metadata(folder)
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == "step":
            metadata.storage_data[index] = type(info)("../outside.distcp", info.offset,
                                                      info.length)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    shutil.copy(os.path.join(folder, "__0_0.distcp"), tmp_path / "outside.distcp")
    with pytest.raises(UnsafePickle, match=r"names data file '\.\./outside\.distcp' outside "
                                              r"its folder: refusing it$"):
        safe_load.check_dist_checkpoint(folder)
    metadata.storage_data = ["not", "a", "table"]  # only allowed types, in the wrong places
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafePickle, match=r"\.metadata is corrupt or not a checkpoint "
                                              r"\(AttributeError: "):
        safe_load.check_dist_checkpoint(folder)


def test_the_loader_leaves_torchs_registered_globals_as_they_were(tmp_path):
    import argparse

    path = str(tmp_path / "args.pt")
    torch.save({"args": argparse.Namespace(lr=1.0)}, path)
    before = list(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals([argparse.Namespace])  # as megatron-core does
    try:
        assert safe_load.torch_load(open(path, "rb").read(), path)["args"].lr == 1.0
        assert argparse.Namespace in torch.serialization.get_safe_globals()
        torch.load(path, weights_only=True)  # megatron-core's own load still reads it
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
