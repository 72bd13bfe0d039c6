"""Crafted checkpoints: what the author of a torch_dist checkpoint (who also writes its
manifest) can change. Each helper changes a copy in place and re-seals the manifest as that
author would, so only the checks that do not trust the author are left to refuse it."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch


def reseal(folder) -> None:
    """Re-hash every file the manifest of ``folder`` lists and write it again (its own
    SHA-256 included) through the trainer's writer; nothing without a manifest."""
    from megatron.sdp4bit.training.checkpoint import files, integrity

    folder = str(folder)
    if not os.path.exists(os.path.join(folder, files.MANIFEST)):
        return  # a foreign (Megatron-LM) checkpoint: nothing to seal
    with open(os.path.join(folder, files.MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    entries = {n: integrity.file_hash(os.path.join(folder, n)) for n in manifest["files"]}
    files.write_manifest(folder, manifest["iteration"], entries, manifest["settings"])


def edit_settings(folder, change: Callable[[dict], Any], *, seal: bool = True) -> None:
    """``change(settings)`` of the manifest of ``folder``; re-sealed unless ``seal`` is False
    (a hand edit that leaves the manifest's own SHA-256 as it was)."""
    path = os.path.join(str(folder), "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    change(manifest["settings"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    if seal:
        reseal(folder)


def rewrite_metadata(folder, change: Callable[[Any], Any]) -> None:
    """``change(metadata)`` of the folder's ``.metadata`` (PyTorch Distributed Checkpoint's
    ``Metadata``: only types its unpickler admits), written back and re-sealed."""
    from megatron.sdp4bit.training.checkpoint import safe_load

    metadata = safe_load.read_dcp_metadata(str(folder))
    change(metadata)
    with open(os.path.join(str(folder), ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    reseal(folder)


def point_at(metadata, name: str | Callable[[str], str],
             keys: Callable[[Any], bool] = lambda index: True) -> int:
    """Point the storage of every entry whose index ``keys`` accepts at data file ``name``
    (or ``name(its file)``), offsets kept; returns how many."""
    count = 0
    for index, info in list(metadata.storage_data.items()):
        if keys(index):
            where = name(info.relative_path) if callable(name) else name
            metadata.storage_data[index] = type(info)(where, info.offset, info.length,
                                                      info.transform_descriptors)
            count += 1
    return count


def append_tensor(folder, metadata, key: str, tensor: torch.Tensor) -> None:
    """Make ``key`` one chunk holding ``tensor``: a ``torch.save`` of it appended to the first
    data file, its entry, size and chunk rewritten to agree (a self-consistent change)."""
    import io

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    entry = metadata.state_dict_metadata[key]
    name = next(iter(metadata.storage_data.values())).relative_path
    path = os.path.join(str(folder), name)
    data = io.BytesIO()
    torch.save(tensor.clone(), data)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(data.getvalue())
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    info = next(iter(metadata.storage_data.values()))
    zeros = torch.Size([0] * tensor.dim())
    metadata.storage_data[MetadataIndex(key, zeros)] = type(info)(name, offset,
                                                                 len(data.getvalue()))
    entry.size = tensor.shape
    entry.chunks = [ChunkStorageMetadata(offsets=zeros, sizes=tensor.shape)]
