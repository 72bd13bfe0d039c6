"""The restricted unpicklers of training/checkpoint/safe_load.py on a small torch_dist folder
written by PyTorch Distributed Checkpoint itself: crafted pickles planted in ``.metadata``,
``common.pt``, an object inside a ``.distcp`` file and a per-rank file are refused in one
line naming the file and the type, and their code never runs (a marker file never appears).
The entries a ``.metadata`` names are checked first: files outside the folder, a FIFO, sizes
past a file's end, shapes that lie are one line each. The trainer's and the tools' runs on
planted checkpoints are in tests/e2e/test_untrusted_contents.py and tests/unit/test_export_hf.py."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import shutil
import signal
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.sdp4bit.training.checkpoint import files, safe_load
from megatron.sdp4bit.training.checkpoint.files import CheckpointError
from megatron.sdp4bit.training.checkpoint.safe_load import UnsafePickle
from tests.helpers import crafted


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


DAMAGED = "the checkpoint is damaged or was crafted: refusing it"


def _crafted(tmp_path, name: str, change) -> str:
    """A copy of the small folder whose ``.metadata`` ``change`` rewrote (allowed types
    only: the restricted unpickler admits it)."""
    folder = _folder(tmp_path / name)
    metadata = safe_load.read_dcp_metadata(folder)
    change(metadata)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return folder


def _refused(folder: str, listed=None) -> str:
    with pytest.raises(UnsafePickle) as err:
        safe_load.check_dist_checkpoint(folder, *([] if listed is None else [listed]))
    return str(err.value)


@contextlib.contextmanager
def _deadline(seconds: int = 30):
    """Fail instead of hanging (an open of a FIFO without a writer blocks for ever)."""
    def expired(*_):
        raise AssertionError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_every_entry_names_a_listed_regular_file_inside_its_folder(tmp_path):
    """Tensor entries as well as objects: a tensor entry pointing at a file outside the
    folder was read by the trainer's resume and the export (only objects were checked)."""
    outside = tmp_path / "outside.distcp"
    first = _folder(tmp_path / "source")
    shutil.copy(os.path.join(first, "__0_0.distcp"), outside)
    is_w = lambda index: index.fqn == "w"  # noqa: E731
    meta = lambda folder: os.path.join(folder, ".metadata")  # noqa: E731

    folder = _crafted(tmp_path, "tensor", lambda m: crafted.point_at(m, "../outside.distcp",
                                                                       is_w))
    expected = (f"checkpoint file {meta(folder)} names data file '../outside.distcp' for "
                f"tensor w chunk at [0, 0] outside its folder: {DAMAGED}")
    assert _refused(folder) == expected
    outside.rename(tmp_path / "moved")  # refused before it is read: the same line without it
    assert _refused(folder) == expected
    (tmp_path / "moved").rename(outside)

    folder = _crafted(tmp_path, "object", lambda m: crafted.point_at(
        m, str(outside), lambda index: index.fqn == "step"))
    assert _refused(folder) == (f"checkpoint file {meta(folder)} names data file "
                                f"'{outside}' for object step outside its folder: {DAMAGED}")

    # a link inside the folder whose target is outside it
    folder = _crafted(tmp_path, "link", lambda m: crafted.point_at(m, "link.distcp", is_w))
    os.symlink(outside, os.path.join(folder, "link.distcp"))
    assert _refused(folder) == (f"checkpoint file {meta(folder)} names data file "
                                "'link.distcp' for tensor w chunk at [0, 0], which resolves "
                                f"outside its folder (to {outside}): {DAMAGED}")

    # a FIFO inside the folder is refused without being opened
    folder = _crafted(tmp_path, "fifo", lambda m: crafted.point_at(m, "pipe.distcp", is_w))
    os.mkfifo(os.path.join(folder, "pipe.distcp"))
    with _deadline():
        assert _refused(folder) == (
            f"checkpoint file {folder}/pipe.distcp (the data of tensor w chunk at [0, 0]) is "
            "a FIFO, not a regular file: refusing it without opening it")

    # a file the manifest does not list: its SHA-256 was never checked
    folder = _folder(tmp_path / "unlisted")
    assert safe_load.check_dist_checkpoint(folder, os.listdir(folder))
    message = _refused(folder, [".metadata", "common.pt"])
    assert message.startswith(f"checkpoint file {folder}/__0_0.distcp (the data of "), message
    assert message.endswith(f") is not listed in the manifest, so nothing checked its "
                            f"contents: {DAMAGED}"), message

    # only allowed types, in the wrong places
    folder = _crafted(tmp_path, "table", lambda m: setattr(m, "storage_data", ["a", "b"]))
    assert _refused(folder) == (f"checkpoint file {meta(folder)} has no table of data "
                                f"entries: {DAMAGED}")
    folder = _crafted(tmp_path, "keys", lambda m: setattr(m, "storage_data", {
        "step": next(iter(m.storage_data.values()))}))
    assert _refused(folder) == (f"checkpoint file {meta(folder)} keys a data entry by 'step', "
                                f"not by a tensor or object name: {DAMAGED}")


def _set_length(metadata, key: str, length: int) -> None:
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == key:
            metadata.storage_data[index] = type(info)(info.relative_path, info.offset, length)


def _resize(metadata, key: str, size, chunk=None) -> None:
    entry = metadata.state_dict_metadata[key]
    entry.size = torch.Size(size)
    if chunk is not None:
        entry.chunks[0].sizes = torch.Size(chunk)


def test_sizes_offsets_and_shapes_are_checked_before_anything_is_read(tmp_path):
    """An object's length of 2**62 (MemoryError) or 2**63 (OverflowError), a shape that
    lies, an embedding grown 2**24 times (824 GB asked of torch.empty): one line naming the
    entry, nothing read or allocated."""
    data = os.path.join(_folder(tmp_path / "sizes"), "__0_0.distcp")
    size = os.path.getsize(data)
    for length in (2**62, 2**63):
        folder = _crafted(tmp_path, f"length{length}", lambda m: _set_length(m, "step", length))
        assert _refused(folder).endswith(
            f"gives object step bytes {_offset(folder, 'step')} to "
            f"{_offset(folder, 'step') + length} of __0_0.distcp, which holds {size} bytes: "
            f"{DAMAGED}")
    folder = _crafted(tmp_path, "negative", lambda m: _set_length(m, "step", -1))
    assert "gives object step offset " in _refused(folder)

    folder = _crafted(tmp_path, "grown", lambda m: _resize(m, "w", (2 * 2**24, 3)))
    assert _refused(folder) == (
        f"checkpoint file {folder}/.metadata gives tensor w the shape [33554432, 3] "
        f"(100663296 elements), but its chunks hold 6 elements: {DAMAGED}")
    # the shape and its chunk agree, the data stored does not
    folder = _crafted(tmp_path, "lying", lambda m: _resize(m, "w", (4, 3), (4, 3)))
    assert _refused(folder) == (
        f"checkpoint file {folder}/__0_0.distcp holds a float32 tensor of shape [2, 3], the "
        f"entry says float32 [4, 3] for tensor w chunk at [0, 0] (bytes {_offset(folder, 'w')} "
        f"to {_offset(folder, 'w') + _length(folder, 'w')}): {DAMAGED}")
    folder = _crafted(tmp_path, "dtype", lambda m: setattr(
        m.state_dict_metadata["w"].properties, "dtype", torch.bfloat16))
    assert "holds a float32 tensor of shape [2, 3], the entry says bfloat16 [2, 3]" in (
        _refused(folder))
    folder = _crafted(tmp_path, "outside_shape", lambda m: setattr(
        m.state_dict_metadata["w"].chunks[0], "offsets", torch.Size([1, 0])))
    assert _refused(folder) == (
        f"checkpoint file {folder}/.metadata gives tensor w of shape [2, 3] a chunk at [1, 0] "
        f"of size [2, 3], outside it: {DAMAGED}")

    def share(metadata):  # b's entry over w's bytes: the file's size no longer bounds them
        w = next(i for i in metadata.storage_data if i.fqn == "w")
        b = next(i for i in metadata.storage_data if i.fqn == "b")
        metadata.storage_data[b] = metadata.storage_data[w]
    folder = _crafted(tmp_path, "shared", share)
    assert _refused(folder) == (
        f"checkpoint file {folder}/.metadata gives tensor b chunk at [0] and tensor w chunk "
        f"at [0, 0] the same bytes of __0_0.distcp (from {_offset(folder, 'w')}): {DAMAGED}")


def _entry(folder: str, key: str):
    metadata = safe_load.read_dcp_metadata(folder)
    return next(v for i, v in metadata.storage_data.items() if i.fqn == key)


def _offset(folder: str, key: str) -> int:
    return _entry(folder, key).offset


def _length(folder: str, key: str) -> int:
    return _entry(folder, key).length


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    for name in (".metadata", "common.pt"):
        folder = _folder(tmp_path / name.strip("."))
        os.remove(os.path.join(folder, name))
        os.mkfifo(os.path.join(folder, name))
        with _deadline():
            assert _refused(folder) == (f"checkpoint file {folder}/{name} is a FIFO, not a "
                                        "regular file: refused without opening it; remove it")
            with pytest.raises(CheckpointError) as err:
                files.check_trusted(str(tmp_path), folder)
        assert str(err.value) == (f"a file of checkpoint {folder}/{name} is a FIFO, not a "
                                  "regular file: refused without opening it; remove it")


class Sneaky:
    """A type some package registers with torch as safe: building it has an effect."""

    def __init__(self, marker: str = "") -> None:
        self.marker = marker

    def __setstate__(self, state: dict) -> None:
        os.mkdir(state["marker"])


class _Call:
    """Pickles as ``function(*args)``."""

    def __init__(self, function, *args) -> None:
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


class _Build(_Call):
    """Pickles as ``function(*args)`` with ``state`` set on the result."""

    def __init__(self, function, args: tuple, state) -> None:
        super().__init__(function, *args)
        self.state = state

    def __reduce__(self):
        return self.function, self.args, self.state


def _common(tmp_path, name: str, value) -> str:
    folder = _folder(tmp_path / name)
    torch.save({"iteration": 3, "value": value}, os.path.join(folder, "common.pt"))
    return folder


def test_a_common_pt_builds_only_the_projects_types(tmp_path):
    """megatron-core registers types with torch's weights-only loader (argparse's Namespace,
    NumPy arrays, BytesIO, its enums, OptimizerConfig, ...); the loader admits this project's
    list of them, not whatever is registered when it runs."""
    from megatron.core import safe_globals as mcore

    marker = str(tmp_path / "MARKER")
    folder = _common(tmp_path, "sneaky", Sneaky(marker))
    torch.serialization.add_safe_globals([Sneaky])  # as a later release or a package might
    try:
        assert _refused(folder).startswith(f"checkpoint file {folder}/common.pt holds a "
                                           f"pickled {__name__}.Sneaky, which is not a type")
        assert Sneaky in torch.serialization.get_safe_globals()  # left as it was
    finally:
        torch.serialization.clear_safe_globals()
        mcore.register_safe_globals()
    assert not os.path.exists(marker)

    def name(entry) -> str:
        return entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"

    allowed = {name(g) for g in safe_load.allowed_torch_globals()}
    assert {name(g) for g in mcore.SAFE_GLOBALS} - allowed == set(), "a newly registered type"

    # each of megatron-core's types called with a refused type among its arguments: refused
    # while its arguments are read, before it is called
    for n, type_ in enumerate(mcore.SAFE_GLOBALS):
        folder = _common(tmp_path, f"call{n}", _Call(type_, Planted(marker)))
        assert "holds a pickled posix.mkdir, which is not a type" in _refused(folder), type_
    # called with odd values of allowed types: a value or one line, never a traceback
    import io
    import pathlib

    import numpy
    for n, value in enumerate([
            _Call(pathlib.PosixPath, "/etc/passwd"), _Call(io.BytesIO, b"\x80\x04"),
            _Call(numpy.dtype, "O"), _Call(torch.Generator, "meta"),
            # torch's own Generator.__setstate__ crashed the process (SIGSEGV) on this state
            _Build(torch.Generator, (), (torch.zeros(3, dtype=torch.uint8),)),
            _Call(numpy.zeros(1).__reduce__()[0], pathlib.PosixPath, (0,), b"b")]):
        folder = _common(tmp_path, f"odd{n}", value)
        try:
            safe_load.check_dist_checkpoint(folder)
        except UnsafePickle as err:
            assert str(err).startswith(f"checkpoint file {folder}/common.pt "), str(err)
    assert not os.path.exists(marker)


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
