"""Every input the trainer reads, checked before use: one line naming the file and the fix.

megatron-core opens data and caches deep inside dataset construction, on every rank, and a
bad file there surfaces as a traceback per rank, sometimes minutes into the run. This module
checks them first, on rank 0 only, and :func:`verify_inputs` broadcasts the verdict so that
every rank stops together with the same message (``pretrain_gpt.py`` prints it once):

* output folders (``--save``, ``--tensorboard-dir``, ``--metrics-jsonl``'s folder,
  ``--data-cache-path``, ``--wandb-save-dir``) can be written;
* the tokenizer files load (``--vocab-file``/``--merge-file``, ``--tokenizer-model``);
* every data prefix (``--data-path``, ``--train-data-path``, ...) has a ``.bin`` and an
  ``.idx``; the ``.idx`` has megatron-core's magic, version and a known token type; its
  sizes agree with the ``.bin``'s length; it holds documents and tokens; the token ids are
  integers from 0 to below the tokenizer's vocabulary; every split of ``--split`` with a
  non-zero share gets tokens of every prefix;
* every dataset index cache megatron-core would open (``*.npy`` under ``--data-cache-path``,
  else under ``<prefix>/cache/GPTDataset_indices``) is a plain numeric array: megatron-core
  loads them with ``allow_pickle=True``, so a crafted cache would run code (it is refused,
  never opened); every complete cache set of a prefix this run reads indexes that prefix's
  documents and tokens within bounds (:mod:`~megatron.sdp4bit.training.guards.index_cache`).

* what the run reads back and trusts (``--save``, ``--data-cache-path`` or the dataset index
  cache folder beside the data and every cache file in it, the tokenizer files) keeps the
  trust rule of ``megatron/sdp4bit/trusted_paths.py``: this user's or root's, writable by
  nobody else, no link another user made; and megatron-core can write its index cache
  (by default beside the data: a read-only dataset folder is named with
  ``--data-cache-path``).

Checkpoints are checked where they are read
(:mod:`megatron.sdp4bit.training.checkpoint.torch_format`).
"""

from __future__ import annotations

import argparse
import glob
import os
import struct
import tempfile
from collections.abc import Callable
from typing import Any

import numpy
import torch.distributed as dist

from megatron.sdp4bit import trusted_paths
from megatron.sdp4bit.training.guards import index_cache

IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_HEADER = len(IDX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, counts
# megatron-core's IndexedDataset token types (indexed_dataset.DType codes).
TOKEN_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32,
                5: numpy.int64, 6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
# Token ids are all read up to this many bytes of .bin; beyond it, evenly spread samples of
# this total size (a wrong tokenizer shows everywhere).
FULL_SCAN_BYTES = 1 << 30
_CHUNK = 1 << 24


class InputError(ValueError):
    """Bad input found before training: the message is one line naming the file and fix."""


def _writable_dir(flag: str, path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise InputError(f"{flag} {path} is not a writable folder ({err.strerror}): "
                         "choose another path or fix its permissions") from None


def _trusted(path: str, what: str, fix: str) -> None:
    try:
        trusted_paths.check(path, what, fix)
    except trusted_paths.UntrustedPathError as err:
        raise InputError(str(err)) from None


# Output folders the run also reads back and trusts (its checkpoints, the lock and tracker,
# the dataset index caches): held to the trust rule of megatron/sdp4bit/trusted_paths.py.
TRUSTED_OUTPUTS = ("--save", "--data-cache-path")


def check_outputs(args: argparse.Namespace) -> None:
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir),
                       ("--data-cache-path", args.data_cache_path),
                       ("--wandb-save-dir", args.wandb_save_dir or None)):
        if path:
            _writable_dir(flag, path)
            if flag in TRUSTED_OUTPUTS:  # checked once it exists: a new one, as the next run
                _trusted(path, flag, f"give {flag} a folder of yours that only you can write")
    if args.metrics_jsonl:
        if os.path.isdir(args.metrics_jsonl):
            raise InputError(f"--metrics-jsonl {args.metrics_jsonl} is a folder: give a file "
                             "path")
        _writable_dir("--metrics-jsonl", os.path.dirname(os.path.abspath(args.metrics_jsonl)))


def check_tokenizer_files(args: argparse.Namespace) -> None:
    """The tokenizer files (``--vocab-file``, ``--merge-file``, ``--tokenizer-model``, a
    Hugging Face tokenizer folder's files) keep the trust rule; also used by the tools (the
    export's check of a manifest's tokenizer record is ``tokenizers.registry.check_files``,
    the same rule)."""
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if path and os.path.lexists(path):
            try:
                trusted_paths.check_with_entries(
                    path, flag, "copy it to a folder of yours that only you can write",
                    "copy the folder to one of yours that only you can write")
            except trusted_paths.UntrustedPathError as err:
                raise InputError(str(err)) from None


def check_tokenizer(args: argparse.Namespace, build_tokenizer: Callable[[argparse.Namespace], Any]):
    """Build the tokenizer with ``build_tokenizer`` (the trainer's; its constructors check
    their files) and return it. Its files must keep the trust rule first."""
    check_tokenizer_files(args)
    try:
        return build_tokenizer(args)
    except ValueError as err:
        raise InputError(f"{str(err).splitlines()[0]}: check --tokenizer-type and its files"
                         ) from None
    except Exception as err:  # noqa: BLE001 - sentencepiece/tokenizers raise their own types
        raise InputError(f"cannot load the {args.tokenizer_type} files "
                         f"({type(err).__name__}: {str(err).splitlines()[0][:200]}): check "
                         "--vocab-file/--merge-file/--tokenizer-model") from None


DATA_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")


def data_prefixes(data_path: list[str] | None) -> list[str]:
    """The prefixes of one data flag's value ('P' or 'W1 P1 W2 P2 ...')."""
    if not data_path:
        return []
    return list(data_path) if len(data_path) == 1 else list(data_path[1::2])


def data_sources(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, prefix) of every dataset the run reads; none with ``--mock-data``."""
    if args.mock_data:
        return []
    return [(flag, prefix) for flag in DATA_FLAGS
            for prefix in data_prefixes(getattr(args, flag[2:].replace("-", "_"), None))]


def check_indexed_dataset(prefix: str, vocab_size: int, flag: str = "--data-path",
                          split: tuple[str, list[float]] | None = None) -> numpy.ndarray:
    """``prefix.idx``/``prefix.bin`` (given with ``flag``) are a consistent, non-empty
    megatron-core dataset whose token ids are integers in ``[0, vocab_size)``; with ``split``
    (``--split`` as typed and its fractions), every split of non-zero weight gets tokens.
    Returns the sequence lengths (a view of the mapped ``.idx``)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise InputError(f"{flag} {prefix}: {path} does not exist: give the prefix "
                             "of a .bin/.idx pair written by tools/preprocess_data.py")
    try:
        return _check_pair(prefix, idx, bin_, vocab_size, split, flag)
    except OSError as err:
        raise InputError(f"{flag} {prefix}: cannot read {err.filename or prefix} "
                         f"({err.strerror}): fix its permissions") from None


def _check_pair(prefix: str, idx: str, bin_: str, vocab_size: int,
                split: tuple[str, list[float]] | None, flag: str) -> numpy.ndarray:
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(IDX_HEADER)
    if len(head) < IDX_HEADER or head[:len(IDX_MAGIC)] != IDX_MAGIC:
        raise InputError(f"{idx} is not a megatron-core index (bad magic): rebuild it with "
                         "tools/preprocess_data.py")
    version, code, nseq, ndoc = struct.unpack_from("<QBQQ", head, len(IDX_MAGIC))
    if version != 1:
        raise InputError(f"{idx} has index version {version}, expected 1: rebuild it with "
                         "tools/preprocess_data.py")
    if code not in TOKEN_DTYPES:
        raise InputError(f"{idx} names token type code {code}, which megatron-core does not "
                         "know: the file is corrupt; rebuild it")
    body = IDX_HEADER + 4 * nseq + 8 * nseq + 8 * ndoc
    if size not in (body, body + nseq):  # + one mode byte per sequence when multimodal
        raise InputError(f"{idx} is {size} bytes but its header promises {body} "
                         f"({nseq} sequences, {ndoc} document boundaries): the file is "
                         "truncated or corrupt; rebuild it")
    if nseq == 0 or ndoc < 2:
        raise InputError(f"{flag} {prefix} holds no documents: check the input of "
                         "tools/preprocess_data.py")
    raw = numpy.memmap(idx, mode="r", dtype=numpy.uint8)
    lengths = numpy.frombuffer(raw, numpy.int32, nseq, IDX_HEADER)
    docs = numpy.frombuffer(raw, numpy.int64, ndoc, IDX_HEADER + 12 * nseq)
    itemsize = numpy.dtype(TOKEN_DTYPES[code]).itemsize
    tokens = int(lengths.sum(dtype=numpy.int64))
    if (lengths < 0).any() or docs[0] != 0 or docs[-1] != nseq or (numpy.diff(docs) < 0).any():
        raise InputError(f"{idx} has inconsistent sequence lengths or document boundaries: "
                         "the file is corrupt; rebuild it")
    if os.path.getsize(bin_) != tokens * itemsize:
        raise InputError(f"{bin_} is {os.path.getsize(bin_)} bytes but {idx} describes "
                         f"{tokens} tokens of {itemsize} bytes ({tokens * itemsize} bytes): "
                         "the pair does not match or one is truncated; rebuild both with "
                         "tools/preprocess_data.py")
    if tokens == 0:  # numpy cannot even map an empty .bin
        raise InputError(f"{flag} {prefix} holds documents but no tokens: check the input "
                         "of tools/preprocess_data.py")
    smallest, largest, fractional = _token_range(bin_, TOKEN_DTYPES[code], tokens)
    if fractional:
        raise InputError(f"{bin_} holds token id {fractional} (not an integer): the file is "
                         "corrupt; rebuild it with tools/preprocess_data.py")
    if smallest < 0:
        raise InputError(f"{bin_} holds token id {smallest} (negative): the file is corrupt or "
                         "was written with the wrong token type; rebuild it")
    if largest >= vocab_size:
        raise InputError(f"{bin_} holds token id {largest} but the tokenizer has "
                         f"{vocab_size} tokens: the data was made with another tokenizer; "
                         "pass the --tokenizer-type/--vocab-file it was made with")
    if split is not None:
        _check_split(prefix, split, lengths, docs)
    return lengths


def _token_range(path: str, dtype, count: int) -> tuple[int, int, float | None]:
    """(smallest, largest, a non-integer value or None) of the token ids in ``path``."""
    tokens = numpy.memmap(path, mode="r", dtype=dtype, shape=(count,))
    itemsize = numpy.dtype(dtype).itemsize
    step = _CHUNK // itemsize
    starts = range(0, count, step)
    if count * itemsize > FULL_SCAN_BYTES:  # evenly spread chunks, FULL_SCAN_BYTES in all
        n = FULL_SCAN_BYTES // _CHUNK
        starts = [int(i * (count - step) / (n - 1)) for i in range(n)]
    lo, hi, fractional = None, None, None
    for start in starts:
        chunk = tokens[start:start + step]
        if fractional is None and chunk.dtype.kind == "f":
            bad = chunk[~numpy.isfinite(chunk) | (chunk != numpy.floor(chunk))]
            fractional = float(bad[0]) if bad.size else None
        c_lo, c_hi = chunk.min(), chunk.max()
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
    if fractional is not None:
        return 0, 0, fractional
    return int(lo), int(hi), None


def _check_split(prefix: str, split: tuple[str, list[float]], lengths, docs) -> None:
    """megatron-core gives split k the documents ``[round(a_k N), round(b_k N))`` of a
    prefix's N; a split of non-zero weight left without tokens makes its sample loop spin
    forever (no error, no end), so it is refused here."""
    text, fractions = split
    count = len(docs) - 1
    bounds = numpy.cumsum([0.0, *fractions])
    for name, weight, a, b in zip(("train", "validation", "test"), fractions, bounds,
                                  bounds[1:]):
        if weight <= 0:
            continue  # megatron-core builds no dataset for this split
        lo, hi = int(round(a * count)), int(round(b * count))
        tokens = int(lengths[docs[lo]:docs[hi]].sum(dtype=numpy.int64)) if hi > lo else 0
        if tokens == 0:
            raise InputError(f"--split {text} gives the {name} split of --data-path {prefix} "
                             f"{hi - lo} of its {count} documents ({tokens} tokens), and "
                             "megatron-core would wait forever for its samples: give that "
                             "split a larger share or 0, or use more data")


def index_cache_owners(args: argparse.Namespace) -> dict[str, list[str]]:
    """Where megatron-core reads (and writes) its dataset index caches for this run, each
    folder with the prefixes whose caches it holds."""
    prefixes = list(dict.fromkeys(p for _, p in data_sources(args)))
    if args.data_cache_path:
        return {args.data_cache_path: prefixes}
    # megatron-core (0.16 and 0.19, GPTDataset._build_document_sample_shuffle_indices) reads
    # <prefix>/cache/GPTDataset_indices: a folder named after the prefix itself, not beside it.
    owners: dict[str, list[str]] = {}
    for p in prefixes:
        owners.setdefault(os.path.join(os.path.abspath(p), "cache", "GPTDataset_indices"),
                          []).append(p)
    return owners


def index_cache_dirs(args: argparse.Namespace) -> list[str]:
    """The folders of :func:`index_cache_owners`."""
    return list(index_cache_owners(args))


def check_cache_folder(args: argparse.Namespace, folder: str) -> None:
    """The dataset index cache ``folder`` megatron-core reads and writes (``--data-cache-path``,
    else ``<prefix>/cache/GPTDataset_indices``) and every cache file in it keep the trust rule,
    and megatron-core can write there: by default it writes its caches beside the data, and
    in a read-only dataset folder it fails on rank 0 with a traceback while the other ranks
    wait for it."""
    fix = ("pass --data-cache-path a folder of yours that only you can write" if
           not args.data_cache_path else "give --data-cache-path a folder of yours that only "
           "you can write")
    what = "--data-cache-path" if args.data_cache_path else "the dataset index cache folder"
    _trusted(folder, what, fix)
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith((".npy", ".txt")):
                _trusted(os.path.join(folder, name), "dataset index cache",
                         f"delete it (it is rebuilt), or {fix}")
    if not args.data_cache_path:
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
                pass
        except OSError as err:
            raise InputError(f"megatron-core writes its dataset index cache beside the data, in "
                             f"{folder}, and that cannot be written ({err.strerror}): pass "
                             "--data-cache-path a writable folder of yours") from None


def check_index_cache(path: str) -> None:
    """``path`` is a plain numeric ``.npy`` array of the length its header states."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            version = numpy.lib.format.read_magic(f)
            read = (numpy.lib.format.read_array_header_1_0 if version == (1, 0)
                    else numpy.lib.format.read_array_header_2_0)
            shape, _, dtype = read(f)
            offset = f.tell()
    except (ValueError, OSError, SyntaxError) as err:
        raise InputError(f"dataset index cache {path} is not a NumPy array file "
                         f"({str(err).splitlines()[0][:120]}); megatron-core would unpickle it: "
                         "delete it (it is rebuilt) and check who wrote it") from None
    if dtype.hasobject:
        raise InputError(f"dataset index cache {path} holds Python objects, not numbers; "
                         "megatron-core would unpickle it and run code: delete it (it is "
                         "rebuilt) and check who wrote it")
    expected = offset + int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if size != expected:
        raise InputError(f"dataset index cache {path} is {size} bytes, its header says "
                         f"{expected}: it is truncated; delete it (it is rebuilt)")


def check_inputs(args: argparse.Namespace,
                 build_tokenizer: Callable[[argparse.Namespace], Any]) -> None:
    """All checks above, in the order a run needs the inputs; raises :class:`InputError`."""
    check_outputs(args)
    tokenizer = check_tokenizer(args, build_tokenizer)
    fractions = getattr(args, "split_vector", None)
    split = (args.split, fractions) if fractions is not None else None
    lengths = {prefix: check_indexed_dataset(prefix, tokenizer.vocab_size, flag, split)
               for flag, prefix in data_sources(args)}
    for folder, prefixes in index_cache_owners(args).items():
        check_cache_folder(args, folder)
        for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.npy"))):
            check_index_cache(path)
        # megatron-core gets the prefixes stripped (datasets.utils.get_blend_from_list)
        data = {p.strip(): (p + ".idx", lengths[p]) for p in prefixes}
        for files in index_cache.cache_sets(folder):
            try:
                index_cache.check_cache_set(files, data)
            except index_cache.CacheError as err:
                raise InputError(str(err)) from None


def verify_inputs(args: argparse.Namespace,
                  build_tokenizer: Callable[[argparse.Namespace], Any]) -> None:
    """Collective: rank 0 runs :func:`check_inputs`; every rank raises its verdict."""
    verdict = [None]
    if dist.get_rank() == 0:
        try:
            check_inputs(args, build_tokenizer)
        except InputError as err:
            verdict[0] = str(err)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise InputError(verdict[0])
