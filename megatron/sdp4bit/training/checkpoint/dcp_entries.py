"""What a torch_dist folder's ``.metadata`` names, checked before anything reads the data.

PyTorch Distributed Checkpoint's ``.metadata`` maps every tensor chunk and every object of
the checkpoint to bytes of a data file (``_StorageInfo``: a relative path, an offset, a
length), and gives every tensor its global shape and chunks. Its readers trust all of it:
the path is joined to the folder as it is, the bytes are read as they are named, and the
tensors a load fills (the export's, ``torch.empty(size)``) are allocated at the shape it
gives. A crafted or damaged ``.metadata`` (only allowed types, so the restricted unpickler
admits it) could otherwise make a load read a file outside the checkpoint, ask for 2**62
bytes, or allocate terabytes.

[Note: what a .metadata may name]
:func:`check_entries` (rank 0, after the restricted unpickler, before megatron-core or
torch reads the folder) refuses in one line naming the entry:

* a storage path that is not a plain file name of the folder, or that resolves (through
  a link) outside it; a path that is not a regular file (a FIFO is refused without being
  opened); a file the trust rule refuses; and, where there is a manifest, a file it does
  not list (so its SHA-256 was not checked);
* an offset or length that is not a non-negative integer, or bytes past the file's end;
  two entries sharing bytes (the file's size then bounds what all entries read together);
* a tensor whose shape is not non-negative integers, a chunk outside the shape, chunks
  whose elements do not add up to the shape's (so the shape is bounded by the chunks'
  data), a chunk without data;
* a tensor chunk whose stored tensor is not what the entry says: each chunk is a
  ``torch.save`` archive inside the data file; its pickle header (a few hundred bytes) is
  read through an unpickler that admits only a tensor's parts, and its shape and dtype must
  be the chunk's, its storage as large as the archive's uncompressed record for it, which
  must lie inside the entry's bytes. So every byte a load allocates for a tensor is a byte
  of a checked file.

Transforms (PyTorch's optional compression of entries) are refused: this trainer writes
none and does not read them. The cost is a few small reads per chunk, on rank 0: 1.3 s for
5,000 chunks (86 MiB) on the 2-core development machine under load; the manifest's SHA-256
check, where there is one, reads every byte of the files anyway.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import stat
import warnings
import zipfile
from collections.abc import Collection
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata)

from megatron.sdp4bit import trusted_paths

DCP_METADATA = ".metadata"
# A tensor's pickle header in a torch.save archive is ~150 bytes; anything past this is not one
# torch writes.
MAX_HEADER_BYTES = 1 << 20
_DAMAGED = "the checkpoint is damaged or was crafted: refusing it"


class EntryError(ValueError):
    """An entry of a ``.metadata`` that a load must not follow; one line naming it."""


def _label(index: Any) -> str:
    offset = getattr(index, "offset", None)
    fqn = getattr(index, "fqn", index)
    return f"object {fqn}" if offset is None else f"tensor {fqn} chunk at {list(offset)}"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list)) and all(_is_count(v) for v in value):
        return tuple(value)
    return None


def _listed(value: Any) -> str:
    """A shape as ``[2, 3]``, anything else as its repr."""
    shape = _shape(value)
    return str(list(shape)) if shape is not None else repr(value)


class _Files:
    """The data files the entries name: checked once each, sizes kept."""

    def __init__(self, directory: str, listed: Collection[str] | None) -> None:
        self.directory = directory
        self.real = os.path.realpath(directory)
        self.meta = os.path.join(directory, DCP_METADATA)
        self.listed = None if listed is None else set(listed)
        self.sizes: dict[str, int] = {}

    def size(self, name: Any, label: str) -> int:
        if name in self.sizes:
            return self.sizes[name]
        if (not isinstance(name, str) or name in ("", ".", "..") or "\0" in name
                or os.path.basename(name) != name):
            raise EntryError(f"checkpoint file {self.meta} names data file {name!r} for {label} "
                             f"outside its folder: {_DAMAGED}")
        path = os.path.join(self.directory, name)
        real = os.path.realpath(path)
        if os.path.dirname(real) != self.real:
            raise EntryError(f"checkpoint file {self.meta} names data file {name!r} for "
                             f"{label}, which resolves outside its folder (to {real}): "
                             f"{_DAMAGED}")
        try:
            st = os.stat(real)  # never opened before it is known to be a regular file
        except OSError as err:
            raise EntryError(f"checkpoint file {path} (the data of {label}) is missing or "
                             f"unreadable ({err.strerror}): the checkpoint is incomplete; "
                             "load an earlier one") from None
        if not stat.S_ISREG(st.st_mode):
            raise EntryError(f"checkpoint file {path} (the data of {label}) is "
                             f"{trusted_paths.kind(st)}, not a regular file: refusing it "
                             "without opening it")
        found = trusted_paths.problem(path, "checkpoint file")
        if found is not None:
            raise EntryError(f"{found}: refused, another user could change what the run "
                             "reads; copy the checkpoint into a folder of yours that only you "
                             "can write")
        if self.listed is not None and name not in self.listed:
            raise EntryError(f"checkpoint file {path} (the data of {label}) is not listed in "
                             "the manifest, so nothing checked its contents: " + _DAMAGED)
        self.sizes[name] = st.st_size
        return st.st_size


def _check_storage(files: _Files, storage: Any) -> None:
    """Every entry's file, and its bytes inside that file, no two entries sharing bytes."""
    if not isinstance(storage, dict):
        raise EntryError(f"checkpoint file {files.meta} has no table of data entries: "
                         + _DAMAGED)
    spans: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex):
            raise EntryError(f"checkpoint file {files.meta} keys a data entry by {index!r}, "
                             f"not by a tensor or object name: {_DAMAGED}")
        label = _label(index)
        name = getattr(info, "relative_path", None)
        size = files.size(name, label)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_is_count(offset) and _is_count(length)):
            raise EntryError(f"checkpoint file {files.meta} gives {label} offset {offset!r} and "
                             f"length {length!r} in {name}, not byte counts: {_DAMAGED}")
        if offset + length > size:
            raise EntryError(f"checkpoint file {files.meta} gives {label} bytes {offset} to "
                             f"{offset + length} of {name}, which holds {size} bytes: "
                             + _DAMAGED)
        if getattr(info, "transform_descriptors", None):
            raise EntryError(f"checkpoint file {files.meta} stores {label} with transforms "
                             f"{list(info.transform_descriptors)}, which this trainer does "
                             "not read")
        spans[name].append((offset, offset + length, label))
    for name, ranges in spans.items():
        ranges.sort()
        for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
            if start < end:
                raise EntryError(f"checkpoint file {files.meta} gives {first} and {second} the "
                                 f"same bytes of {name} (from {start}): {_DAMAGED}")


class _StorageRef(NamedTuple):
    dtype: torch.dtype  # of the storage's elements (uint8 for an untyped storage)


class _Stored(NamedTuple):
    key: str
    dtype: torch.dtype
    numel: int


class _Tensor(NamedTuple):
    storage: Any
    offset: Any
    size: Any
    stride: Any
    dtype: torch.dtype | None


class _NotATensor(Exception):
    pass


def _rebuild_v2(storage, offset, size, stride, *_rest) -> _Tensor:
    return _Tensor(storage, offset, size, stride, None)


def _rebuild_v3(storage, offset, size, stride, _grad, _hooks, dtype, *_rest) -> _Tensor:
    return _Tensor(storage, offset, size, stride, dtype)


_DTYPES = {n: getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None),
                                                                  torch.dtype)}


def _storage_dtypes() -> dict[str, torch.dtype]:
    """torch's legacy storage classes by name (``FloatStorage``), as torch.save names them."""
    with warnings.catch_warnings():  # reading a legacy class's dtype warns of its deprecation
        warnings.simplefilter("ignore")
        classes = {n: getattr(torch, n) for n in dir(torch) if n.endswith("Storage")}
        return {n: c.dtype for n, c in classes.items()
                if isinstance(getattr(c, "dtype", None), torch.dtype)}


_STORAGE_DTYPES = _storage_dtypes()


class _HeaderUnpickler(pickle.Unpickler):
    """A ``torch.save`` of one tensor, read as its parts (nothing allocated, nothing else
    built)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageRef(torch.uint8)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageRef(_STORAGE_DTYPES[name])
        raise _NotATensor(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Stored:
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageRef) and isinstance(pid[2], str)
                and _is_count(pid[4])):
            return _Stored(pid[2], pid[1].dtype, pid[4])
        raise _NotATensor("a storage record of another form")


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a file of their own."""

    def __init__(self, f, start: int, length: int) -> None:
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)


def _extent(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """Elements of the storage a tensor of this size, stride and offset reaches."""
    if 0 in size:
        return offset
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))


def _stored_problem(f, offset: int, length: int, shape: tuple[int, ...],
                    dtype: torch.dtype) -> str | None:
    """Why the ``torch.save`` archive at ``[offset, offset + length)`` of ``f`` is not one
    tensor of ``shape`` and ``dtype`` whose storage lies inside it (None: it is)."""
    try:
        archive = zipfile.ZipFile(_Slice(f, offset, length))
        names = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")
                 or i.filename == "data.pkl"]
        if len(names) != 1:
            return "no single data.pkl record"
        header = names[0]
        if header.file_size > MAX_HEADER_BYTES or header.compress_type != zipfile.ZIP_STORED:
            return f"a data.pkl record of {header.file_size} bytes"
        prefix = header.filename[:-len("data.pkl")]
        tensor = _HeaderUnpickler(io.BytesIO(archive.read(header))).load()
    except _NotATensor as err:
        return f"a pickled {err}, not a tensor"
    except Exception as err:  # noqa: BLE001 - zipfile and pickle raise many types
        return f"no readable tensor ({type(err).__name__})"
    if not (isinstance(tensor, _Tensor) and isinstance(tensor.storage, _Stored)):
        return "no tensor"
    size, stride = _shape(tensor.size), _shape(tensor.stride)
    storage, start = tensor.storage, tensor.offset
    held = tensor.dtype or storage.dtype
    if size is None or stride is None or len(stride) != len(size) or not _is_count(start):
        return "a tensor of no valid shape"
    if size != shape or held != dtype:
        return (f"a {str(held).removeprefix('torch.')} tensor of shape {list(size)}, the "
                f"entry says {str(dtype).removeprefix('torch.')} {list(shape)}")
    try:
        record = archive.getinfo(f"{prefix}data/{storage.key}")
    except KeyError:
        return f"no record of its storage {storage.key!r}"
    stored = storage.numel * storage.dtype.itemsize
    needed = _extent(size, stride, start) * held.itemsize
    if (record.file_size != stored or record.compress_type != zipfile.ZIP_STORED
            or needed > stored
            or record.header_offset + len(record.filename) + stored > length):
        return (f"a storage of {stored} bytes for a tensor of {needed} bytes, in a record of "
                f"{record.file_size} bytes")
    return None


def _check_tensors(files: _Files, metadata: Metadata, storage: dict) -> None:
    tensors = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(tensors, dict):
        raise EntryError(f"checkpoint file {files.meta} has no table of tensors: {_DAMAGED}")
    chunks_of: dict[str, list[tuple[Any, tuple[int, ...], torch.dtype]]] = \
        collections.defaultdict(list)
    for key, entry in tensors.items():
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(key) not in storage:
                raise EntryError(f"checkpoint file {files.meta} names no data for object "
                                 f"{key}: {_DAMAGED}")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise EntryError(f"checkpoint file {files.meta} describes {key} as "
                             f"{type(entry).__name__}: {_DAMAGED}")
        shape = _shape(entry.size)
        dtype = getattr(entry.properties, "dtype", None)
        chunks = entry.chunks if isinstance(entry.chunks, list) else None
        if shape is None or not isinstance(dtype, torch.dtype) or chunks is None:
            raise EntryError(f"checkpoint file {files.meta} gives tensor {key} the shape "
                             f"{entry.size!r} and dtype {dtype!r}: {_DAMAGED}")
        elements = 0
        for chunk in chunks:
            offsets, sizes = _shape(chunk.offsets), _shape(chunk.sizes)
            if (offsets is None or sizes is None or len(offsets) != len(shape)
                    or len(sizes) != len(shape)
                    or any(o + s > n for o, s, n in zip(offsets, sizes, shape))):
                raise EntryError(f"checkpoint file {files.meta} gives tensor {key} of shape "
                                 f"{list(shape)} a chunk at {_listed(chunk.offsets)} of size "
                                 f"{_listed(chunk.sizes)}, outside it: {_DAMAGED}")
            index = MetadataIndex(key, torch.Size(offsets))
            if index not in storage:
                raise EntryError(f"checkpoint file {files.meta} names no data for "
                                 f"{_label(index)}: {_DAMAGED}")
            elements += math.prod(sizes)
            chunks_of[storage[index].relative_path].append((index, sizes, dtype))
        if elements != math.prod(shape):
            raise EntryError(f"checkpoint file {files.meta} gives tensor {key} the shape "
                             f"{list(shape)} ({math.prod(shape)} elements), but its chunks "
                             f"hold {elements} elements: {_DAMAGED}")
    for name, chunks in chunks_of.items():
        path = os.path.join(files.directory, name)
        with open(path, "rb") as f:
            for index, sizes, dtype in chunks:
                info = storage[index]
                problem = _stored_problem(f, info.offset, info.length, sizes, dtype)
                if problem is not None:
                    raise EntryError(f"checkpoint file {path} holds {problem} for "
                                     f"{_label(index)} (bytes {info.offset} to "
                                     f"{info.offset + info.length}): {_DAMAGED}")


def check_entries(directory: str, metadata: Metadata,
                  listed: Collection[str] | None = None) -> None:
    """Check every entry of the folder's ``.metadata`` (see [Note: what a .metadata may
    name]); ``listed``: the file names of its manifest (None: it has none). Raises
    :class:`EntryError`."""
    files = _Files(directory, listed)
    storage = getattr(metadata, "storage_data", None)
    _check_storage(files, storage)
    _check_tensors(files, metadata, storage)


def object_bytes(directory: str, metadata: Metadata) -> list[tuple[str, str, bytes]]:
    """(file, key, bytes) of every non-tensor object of a folder whose entries
    :func:`check_entries` accepted."""
    keys = {k for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata)}
    out = []
    for index, info in metadata.storage_data.items():  # keys checked: MetadataIndex
        if index.fqn in keys and index.offset is None:
            path = os.path.join(directory, info.relative_path)
            with open(path, "rb") as f:
                f.seek(info.offset)
                out.append((path, index.fqn, f.read(info.length)))
    return out
