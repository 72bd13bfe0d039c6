"""What a checkpoint holds is not trusted for being the user's own file.

No code runs from a checkpoint's pickles: the trainer's resume, ``--finetune`` of a
manifest-less checkpoint and tools/checkpoint/export_hf.py on a torch_dist checkpoint whose
``.metadata`` is a crafted pickle (its manifest rewritten to match, as its author would).
Each stops with one line naming the file and the refused type, and the marker directory the
pickle would create never appears. Nor does a ``.metadata`` of allowed types only lead a
load astray: tensor entries naming files outside the folder, a stored shape this run's model
does not have, an object's length of 2**62 are one line each, before megatron-core reads the
folder. The unpicklers and the entry checks themselves, on every kind of pickle and entry a
checkpoint holds: tests/unit/training/checkpoint/test_safe_load.py (the export's:
tests/unit/test_export_hf.py)."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from tests.helpers import crafted
from tests.helpers import launch as _launch
from tests.helpers.trainer import ROOT, TINY, launch, one_error_line, torchrun, trainer_env

# SDP4Bit's own checks of a checkpoint's files, before megatron-core reads the folder; the
# save, the resume and the export they guard: test_dist_checkpoint.py, in both passes
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.release_independent]

RUN = list(TINY)
for _flag, _value in (("--train-iters", "2"), ("--lr-warmup-iters", "1"),
                      ("--eval-interval", "100")):
    RUN[RUN.index(_flag) + 1] = _value
RUN += ["--ckpt-format", "torch_dist"]


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant_metadata(root, marker: str, *, manifest: bool) -> str:
    folder = os.path.join(root, "iter_0000002")
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(_Planted(marker), f)
    if not manifest:
        os.remove(os.path.join(folder, "manifest.json"))
        return folder
    crafted.reseal(folder)
    return folder


@pytest.fixture(scope="module")
def saved(data_prefix, tmp_path_factory):
    """A 2-rank torch_dist checkpoint of the tests' corpus at iteration 2."""
    folder = tmp_path_factory.mktemp("saved")
    torchrun(RUN + data_prefix + ["--save", str(folder), "--save-interval", "2"], nproc=2)
    return folder


def _export(load, output, *extra: str):
    return _launch.python(os.path.join(ROOT, "tools", "checkpoint", "export_hf.py"),
                          ["--load", str(load), "--output", str(output), *extra],
                          env=trainer_env(), cwd=ROOT, timeout=300)


def test_a_crafted_metadata_runs_no_code_in_the_trainer_or_the_export(data_prefix, saved,
                                                                      tmp_path):
    marker = str(tmp_path / "MARKER")
    refused = ("holds a pickled posix.mkdir, which is not a type a checkpoint holds: refusing "
               "to read it (unpickling it would run code); take the checkpoint from a source "
               "you trust")

    resumed = tmp_path / "resumed"  # the author also wrote the manifest
    shutil.copytree(saved, resumed)
    folder = _plant_metadata(resumed, marker, manifest=True)
    message = one_error_line(launch(RUN + data_prefix + ["--load", str(resumed)], nproc=2))
    assert message == f"checkpoint file {folder}/.metadata {refused}"

    res = _export(resumed, tmp_path / "hf")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stderr == f"export_hf.py: error: checkpoint file {folder}/.metadata {refused}\n"
    assert not os.path.exists(tmp_path / "hf")

    foreign = tmp_path / "foreign"  # a manifest-less (Megatron-LM) checkpoint
    shutil.copytree(saved, foreign)
    folder = _plant_metadata(foreign, marker, manifest=False)
    # a model that does not fit: the shape check must not read the metadata first
    message = one_error_line(launch(RUN + data_prefix + ["--finetune", "--load", str(foreign),
                                                         "--ffn-hidden-size", "128"], nproc=2))
    assert message == f"checkpoint file {folder}/.metadata {refused}"
    assert not os.path.exists(marker)


DAMAGED = "the checkpoint is damaged or was crafted: refusing it"


def _copy(saved, tmp_path, name: str):
    root = tmp_path / name
    shutil.copytree(saved, root)
    return root, root / "iter_0000002"


def test_tensor_entries_outside_the_folder_are_refused_before_megatron_core_reads(
        data_prefix, saved, tmp_path):
    """The resume trained (rc 0) from .distcp files outside the folder that the tensor
    entries named, the manifest re-hashed by the checkpoint's author."""
    root, folder = _copy(saved, tmp_path, "crafted")
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in os.listdir(folder):
        if name.endswith(".distcp"):
            shutil.copy(folder / name, outside / name)
    crafted.rewrite_metadata(folder, lambda m: crafted.point_at(
        m, lambda name: f"../../outside/{name}", lambda index: index.offset is not None))
    message = one_error_line(launch(RUN + data_prefix + ["--load", str(root)], nproc=2))
    assert message.startswith(f"checkpoint file {folder}/.metadata names data file "
                              "'../../outside/__"), message
    assert message.endswith(f" outside its folder: {DAMAGED} (no other complete checkpoint is "
                            f"in {root})"), message


def test_a_stored_shape_this_model_lacks_is_one_line_before_megatron_core_loads(
        data_prefix, saved, tmp_path):
    """A .metadata whose final norm (shape, chunk and data alike) is longer than the
    manifest's model gives: megatron-core's `Global shape mismatch` was a traceback on every
    worker. (The embedding and output layer megatron-core loads at any stored size, their
    rows being the padded vocabulary; the entry checks bound that size by the data.)"""
    key = "decoder.final_layernorm.weight"
    root, folder = _copy(saved, tmp_path, "grown")
    shape: list = []

    def grow(metadata):
        entry = metadata.state_dict_metadata[key]
        shape.extend(entry.size)
        crafted.append_tensor(folder, metadata, key, torch.zeros(
            entry.size[0] + 16, dtype=entry.properties.dtype))
    crafted.rewrite_metadata(folder, grow)
    message = one_error_line(launch(RUN + data_prefix + ["--load", str(root)], nproc=2))
    hidden, = shape
    assert message == (
        f"checkpoint {folder} does not hold the tensors this run loads, although its manifest "
        f"records this run's model: {key} is [{hidden + 16}] there, [{hidden}] here: the "
        "checkpoint is damaged or was altered; load an earlier one (no other complete "
        f"checkpoint is in {root})")


def test_an_objects_length_past_its_file_is_one_line_in_a_weights_only_start(
        data_prefix, saved, tmp_path):
    """An object entry's length of 2**62: the checker's own read was a MemoryError (2**63:
    OverflowError), here in --finetune of a manifest-less (Megatron-LM) checkpoint."""
    root, folder = _copy(saved, tmp_path, "length")
    os.remove(folder / "manifest.json")
    found: list = []

    def lengthen(metadata):
        index, info = next((i, v) for i, v in metadata.storage_data.items() if i.offset is None)
        metadata.storage_data[index] = type(info)(info.relative_path, info.offset, 2**62)
        found.append((index.fqn, info))
    crafted.rewrite_metadata(folder, lengthen)
    (key, info), = found
    size = os.path.getsize(folder / info.relative_path)
    message = one_error_line(launch(RUN + data_prefix + ["--finetune", "--load", str(root)],
                                    nproc=2))
    assert message == (
        f"checkpoint file {folder}/.metadata gives object {key} bytes {info.offset} to "
        f"{info.offset + 2**62} of {info.relative_path}, which holds {size} bytes: {DAMAGED}")
