"""Reading a checkpoint's pickles without running code from them.

A checkpoint holds pickles in three places: the per-rank files of ``--ckpt-format torch``,
and in a torch_dist folder its ``.metadata`` (PyTorch Distributed Checkpoint's index,
``pickle.dump`` of a ``Metadata``), its ``common.pt`` (megatron-core 0.16; ``torch.save``)
and the non-tensor objects inside its ``.distcp`` files (``torch.save`` of each object:
the RNG states, the optimizer's common part, megatron-core 0.19's common state). A pickle
names the functions it calls while it is read, so a crafted one runs its author's code.

[Note: what is unpickled from a checkpoint, and how]
Every pickle of a checkpoint, ours or a foreign one (Megatron-LM's, a downloaded one), is
read by an unpickler that admits only the types such a file legitimately holds:

* ``torch.save`` pickles (per-rank files, ``common.pt``, the ``.distcp`` objects) by
  ``torch.load(weights_only=True)``: tensors, plain containers and numbers, and this
  project's list of the types megatron-core registers (:data:`TORCH_GLOBALS`: the argparse
  Namespace, its enums, NumPy arrays, ...), pinned by name: a type someone else registers
  with torch (a later megatron-core, another package) is refused until it is added to the
  list. Building an admitted type runs its own constructor (megatron-core's, NumPy's,
  torch's) with the pickle's arguments, never code of the pickle's choosing;
* ``.metadata`` by :class:`_MetadataUnpickler`, which admits exactly the classes PyTorch
  Distributed Checkpoint writes there (:data:`METADATA_GLOBALS`, and torch's dtypes).

Anything else stops the load with one line naming the file and the refused type, before
megatron-core or torch reads the folder: :func:`check_dist_checkpoint` reads (and discards)
every pickle of a torch_dist folder this way first, as the first step of every load of one,
after the manifest's SHA-256 check where there is a manifest. megatron-core then reads the
same files with its own loaders (``pickle.load`` for ``.metadata``, ``weights_only=False``
for the objects); the check proved what they hold, so nothing but the allowed types is
built. The files cannot change between the two reads but by someone who may write them,
and the trust rule (``megatron/sdp4bit/trusted_paths.py``, checked before) leaves that to
this user alone: the two rules together cover a checkpoint's contents (this one) and its
ownership (that one). This keeps megatron-core's and torch's loaders as they are (no entry
of the replacement table) on both tested releases, whose loaders differ (0.19 keeps the
common state inside the ``.distcp`` files). The SHA-256 check alone cannot stand for this
one: a manifest is written by the checkpoint's author, who may be the attacker.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import pickle
import re
from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from megatron.sdp4bit import trusted_paths
from megatron.sdp4bit.training.checkpoint import dcp_entries

DCP_METADATA = ".metadata"
COMMON = "common.pt"

_DCP = "torch.distributed.checkpoint"
# What PyTorch Distributed Checkpoint pickles into ``.metadata`` (torch 2.x): its metadata
# dataclasses, the filesystem storage entries, the saved plans, sizes, layouts and paths.
METADATA_GLOBALS = frozenset({
    (f"{_DCP}.metadata", "Metadata"), (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"), (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"), (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"), (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.planner", "SavePlan"), (f"{_DCP}.planner", "WriteItem"),
    (f"{_DCP}.planner", "WriteItemType"), (f"{_DCP}.planner", "TensorWriteData"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"),  # the saver's checkpoint id
})

# torch's dtypes, pickled by name (``torch.bfloat16``): looked up here, not with getattr.
_DTYPES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))

# The types a ``torch.save`` pickle of a checkpoint may hold beyond torch's own (tensors, plain
# containers, numbers): module -> names. Exactly what megatron-core 0.16.1 and 0.19.2 register
# with ``torch.serialization.add_safe_globals`` at import (``megatron/core/safe_globals.py``):
# Megatron-LM's saved arguments and their enums, the RNG states' NumPy arrays, the rerun
# state machine's state, Transformer Engine's extra state (a BytesIO). The list is this
# project's: what another release or another package registers is not admitted until it is
# added here ([Note: what is unpickled from a checkpoint, and how]).
TORCH_GLOBALS: dict[str, tuple[str, ...]] = {
    "argparse": ("Namespace",), "types": ("SimpleNamespace",), "pathlib": ("PosixPath",),
    "io": ("BytesIO",), "signal": ("Signals",), "numpy": ("ndarray", "dtype"),
    "numpy.dtypes": ("UInt32DType",),
    "megatron.core.enums": ("ModelType",),
    "megatron.core.optimizer": ("OptimizerConfig",),
    "megatron.core.rerun_state_machine": ("RerunDiagnostic", "RerunMode", "RerunState"),
    "megatron.core.transformer.enums": ("AttnBackend", "CudaGraphScope", "CudaGraphModule",
                                        "InferenceCudaGraphScope"),
}


class _CheckedGenerator:
    """Stands for ``torch.Generator`` (which megatron-core 0.19 registers) while a pickle is
    checked: torch's own ``__setstate__`` indexes a malformed state without checking it and
    crashes the process (SIGSEGV, seen with a one-element state), so the state's form is
    checked first. The check's objects are discarded; a state that passes is one torch's
    loader reads safely when megatron-core loads the file."""

    def __init__(self, device: Any = None) -> None:
        self._generator = torch.Generator(device)

    def __setstate__(self, state: Any) -> None:
        size = self._generator.get_state().numel()
        if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], int)
                and (state[1] is None or isinstance(state[1], int))
                and isinstance(state[2], torch.Tensor) and state[2].dtype == torch.uint8
                and state[2].dim() == 1 and state[2].numel() == size):
            raise ValueError(f"a torch.Generator state that is not (seed, offset, {size} "
                             "bytes)")
        self._generator.__setstate__(state)


@functools.lru_cache(maxsize=None)
def allowed_torch_globals() -> tuple[Any, ...]:
    """The objects of :data:`TORCH_GLOBALS` (a name this megatron-core release lacks is left
    out), NumPy's array rebuilder and torch's Generator, checked (both megatron-core's too);
    each an object or (object, the name pickles give it), as torch registers them."""
    import numpy

    found: list[Any] = [(_CheckedGenerator, "torch._C.Generator")]
    for module, names in TORCH_GLOBALS.items():
        imported = importlib.import_module(module)
        found += [getattr(imported, n) for n in names if hasattr(imported, n)]
    # NumPy moved it (numpy.core -> numpy._core); pickles name the module that wrote them
    core = getattr(numpy, "_core", None) or numpy.core
    found.append(core.multiarray._reconstruct)
    return tuple(found)


@contextlib.contextmanager
def _only_allowed_globals():
    """torch's weights-only loader admits :func:`allowed_torch_globals` and nothing else
    registered (megatron-core's or any package's own registrations are put back after)."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        torch.serialization.add_safe_globals(list(allowed_torch_globals()))
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(registered)


class UnsafePickle(ValueError):
    """A checkpoint file that holds a refused type, or is damaged: the one-line message names
    the file (the loaders turn it into their ``CheckpointError``)."""


class _Refused(Exception):
    """A type the unpickler does not admit (its dotted name)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def refusal(path: str, what: str) -> str:
    return (f"checkpoint file {path} holds a pickled {what}, which is not a type a checkpoint "
            "holds: refusing to read it (unpickling it would run code); take the checkpoint "
            "from a source you trust")


def _corrupt(path: str, err: BaseException) -> UnsafePickle:
    return UnsafePickle(f"checkpoint file {path} is corrupt or not a checkpoint "
                        f"({type(err).__name__}: {str(err).splitlines()[0][:160]})")


def read_dcp_metadata(directory: str) -> Metadata:
    """The ``.metadata`` of a torch_dist folder, through the restricted unpickler."""
    path = os.path.join(directory, DCP_METADATA)
    found = trusted_paths.kind_problem(path, "checkpoint file")
    if found is not None:  # a FIFO would block the open below forever
        raise UnsafePickle(found)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as refused:
        raise UnsafePickle(refusal(path, str(refused))) from None
    except OSError as err:
        raise UnsafePickle(f"cannot read checkpoint file {path} ({err.strerror}): the "
                           "checkpoint is incomplete or unreadable") from None
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises many types
        raise _corrupt(path, err) from None
    if not isinstance(metadata, Metadata):
        raise UnsafePickle(refusal(path, type(metadata).__name__))
    return metadata


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def torch_load(data: bytes, label: str) -> Any:
    """``torch.load(weights_only=True)`` of ``data`` (what file ``label`` holds), admitting
    exactly :func:`allowed_torch_globals` beyond torch's own types; a refused type or a
    damaged file is one line naming it."""
    try:
        with _only_allowed_globals():
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = _GLOBAL.search(str(err))
        if found is None and "weights only load failed" not in str(err).lower():
            raise _corrupt(label, err) from None
        what = found.group(1) if found else "object torch's weights-only loader refuses"
        raise UnsafePickle(refusal(label, what)) from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for foreign files
        raise _corrupt(label, err) from None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise UnsafePickle(f"cannot read checkpoint file {path} ({err.strerror}): the "
                           "checkpoint is incomplete or unreadable") from None


def check_dist_checkpoint(directory: str, listed: Collection[str] | None = None) -> Metadata:
    """Read every pickle of a torch_dist folder through the restricted unpicklers (see
    [Note: what is unpickled from a checkpoint, and how]), after checking every entry its
    ``.metadata`` names (``dcp_entries.py``; ``listed``: the file names of the folder's
    manifest, None where it has none); returns its ``.metadata``. Raises
    :class:`UnsafePickle` naming the file."""
    meta = os.path.join(directory, DCP_METADATA)
    metadata = read_dcp_metadata(directory)
    try:
        dcp_entries.check_entries(directory, metadata, listed)
    except dcp_entries.EntryError as err:
        raise UnsafePickle(str(err)) from None
    except OSError as err:
        raise UnsafePickle(f"cannot read the data files of checkpoint {directory} "
                           f"({err.strerror}): the checkpoint is incomplete") from None
    except (AttributeError, TypeError, ValueError) as err:  # allowed types, wrong values
        raise _corrupt(meta, err) from None
    common = os.path.join(directory, COMMON)
    found = trusted_paths.kind_problem(common, "checkpoint file")
    if found is not None:  # megatron-core opens it next
        raise UnsafePickle(found)
    if os.path.isfile(common):
        torch_load(_read(common), common)
    try:
        objects = dcp_entries.object_bytes(directory, metadata)
    except OSError as err:
        raise UnsafePickle(f"cannot read the data files of checkpoint {directory} "
                           f"({err.strerror}): the checkpoint is incomplete") from None
    for path, key, data in objects:
        torch_load(data, f"{path} (object {key})")
    return metadata


def dist_checkpoint_problem(directory: str, listed: Collection[str] | None) -> str | None:
    """Collective: rank 0 runs :func:`check_dist_checkpoint` (``listed``: the manifest's file
    names, None without one); every rank gets its problem (None: the folder's entries are
    sound and every pickle holds only the allowed types)."""
    import torch.distributed as dist

    problem: list = [None]
    if dist.get_rank() == 0:
        try:
            check_dist_checkpoint(directory, listed)
        except UnsafePickle as err:
            problem[0] = str(err)
    dist.broadcast_object_list(problem, src=0)
    return problem[0]


def safe_reader(directory: str):
    """A PyTorch Distributed Checkpoint ``FileSystemReader`` of ``directory`` whose
    ``.metadata`` goes through :func:`read_dcp_metadata` (for the tools, which load with
    ``torch.distributed.checkpoint`` directly)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata = read_dcp_metadata(directory)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(directory)
