"""The values inside megatron-core's GPTDataset index caches, checked against the data.

megatron-core (0.16 and 0.19, ``gpt_dataset.py``) finds a cache hit when the four files
``<hash>-GPTDataset-<split>-{description.txt,document_index.npy,sample_index.npy,
shuffle_index.npy}`` exist (``_build_document_sample_shuffle_indices``), maps the three
arrays and trusts every value in them. A sample ``i`` is read
(``_query_document_sample_shuffle_indices``) as::

    j = shuffle_index[i]
    (p0, o0), (p1, o1) = sample_index[j], sample_index[j + 1]
    tokens of document_index[p0] from o0, ..., of document_index[p1] up to o1 + extra

with ``IndexedDataset.get(document, offset, length)``, which checks nothing: a document id
past the end raises an IndexError deep in training, a negative one wraps to another document,
and an offset past a document reads the next document's tokens (or past the ``.bin``).
``helpers.cpp`` ``build_sample_idx`` and ``gpt_dataset.py`` write, and this module requires
(``extra`` is ``add_extra_token_to_sequence``, 1 in this trainer):

* ``document_index``: 1-D int32 (``_build_document_index``: ``astype(numpy.int32)``), every
  entry a sequence id of the data, ``0 <= d < `` the ``.idx``'s sequence count;
* ``sample_index``: ``(num_samples + 1, 2)``, int32, or int64 once the document index or a
  document outgrows int32 (``helpers.build_sample_idx``); row ``k`` is (document position
  ``p``, token offset ``o``) where sample ``k`` starts and sample ``k - 1`` ends; row 0 is
  (0, 0); ``0 <= p < len(document_index)``; rows do not decrease in (``p``, ``o``) (a
  decreasing pair reads nothing, or with one position ``o1 - o0 + extra`` turns negative and
  reads to the end of the file); for rows after the first ``0 <= o <= len(document) - extra``
  (``doc_offset += remaining + document_length - extra`` never passes the document's last
  start; megatron-core asserts ``sample_idx.min() >= 0``); with ``extra = 0`` an offset may
  equal the document's length; every sample spans exactly ``sequence_length`` tokens of the
  documents in order, the last one 1 to ``sequence_length`` (``drop_last_partial_sequence``
  off pads it); at least the description's ``num_samples`` samples (the epochs are rounded up
  to them, ``_get_num_epochs``);
* ``shuffle_index``: 1-D, uint32, or int64 from ``2**32 - 2`` samples on
  (``_build_shuffle_index``), one entry per sample (``sample_index.shape[0] - 1``), each in
  ``[0, num_samples)``.

A set missing any of the four files is no hit: megatron-core rebuilds and overwrites it, so it
is not checked here. The description is the JSON text whose MD5 is ``<hash>`` (megatron-core's
``MegatronDataset.unique_description``); its ``dataset_path`` is the prefix as the writing run
passed it (possibly relative to that run's folder), and the hash covers it: this run opens the
set only if it passes the same prefix string, so a set is checked against the ``.idx`` of the
run's prefix of that name and a set of any other prefix is left alone (megatron-core never
opens it). A description that does not hash to its name ties the arrays to no data and is
refused. Deleting any one file of a set makes megatron-core rebuild all of it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re

import numpy

SUFFIXES = ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
CACHE_NAME = re.compile(r"^([0-9a-f]{32})-GPTDataset-(train|valid|test)-(" +
                        "|".join(re.escape(s) for s in SUFFIXES) + ")$")
# The trainer's GPTDatasetConfig keeps megatron-core's add_extra_token_to_sequence=True.
EXTRA_TOKEN = 1
# Entries per chunk: every pass reads its arrays once, in order, a chunk at a time (a few
# int64 copies of one chunk, some tens of MiB), and never holds a whole array.
_CHUNK = 1 << 20
_FIX = "delete it (it is rebuilt)"


class CacheError(ValueError):
    """A cache set megatron-core would trust but must not: one line naming the file."""


def cache_sets(folder: str) -> list[dict[str, str]]:
    """The complete sets (``{suffix: path}``, all four files) of GPTDataset caches in
    ``folder``, in name order."""
    groups: dict[str, dict[str, str]] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*-GPTDataset-*"))):
        match = CACHE_NAME.match(os.path.basename(path))
        if match and os.path.isfile(path):
            groups.setdefault(match.group(1) + match.group(2), {})[match.group(3)] = path
    return [files for files in groups.values() if len(files) == len(SUFFIXES)]


def _description(path: str) -> dict:
    name_hash = os.path.basename(path)[:32]
    with open(path, "rb") as f:
        text = f.read()
    if hashlib.md5(text, usedforsecurity=False).hexdigest() != name_hash:
        raise CacheError(f"dataset index cache {path} does not hash to the {name_hash} its name "
                         "carries (edited, or renamed from another set), so its arrays belong "
                         f"to no known data: {_FIX}")
    try:
        description = json.loads(text)
        seq = description["sequence_length"]
        num = description["num_samples"]
        if not (isinstance(description["dataset_path"], str) and type(seq) is int and seq > 1
                and (num is None or (type(num) is int and num >= 0))):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise CacheError(f"dataset index cache {path} is not a GPTDataset description (JSON "
                         f"with dataset_path, num_samples, sequence_length): {_FIX}") from None
    return description


def check_cache_set(files: dict[str, str], data: dict[str, tuple[str, numpy.ndarray]],
                    extra: int = EXTRA_TOKEN) -> None:
    """Raise :class:`CacheError` unless the set ``files`` (of :func:`cache_sets`; every
    ``.npy`` already passed ``preflight.check_index_cache``, so none is a pickle) indexes its
    data within bounds. ``data`` maps each prefix of this run that reads the set's folder, as
    megatron-core gets it (stripped), to its ``.idx`` path and sequence lengths (the preflight's
    reading of the ``.idx``).

    Cost: one pass over each array in chunks of ``_CHUNK`` entries, plus the length of every
    document position gathered from the ``.idx`` map (once or twice): O(entries) time and
    O(``_CHUNK``) memory besides the mapped files' pages. Measured on 2 busy CPU cores: 2.3 s
    for 25 million samples over 4 million document positions (about 0.1 us a sample), so
    some tens of seconds for hundreds of millions.
    """
    if not data:
        return  # a --mock-data run: megatron-core opens MockGPTDataset sets only
    description = _description(files["description.txt"])
    if description["dataset_path"] not in data:
        return  # another prefix's set: this run's hash differs, megatron-core never opens it
    idx, lengths = data[description["dataset_path"]]
    document, sample, shuffle = (numpy.load(files[s], mmap_mode="r", allow_pickle=False)
                                 for s in SUFFIXES[1:])
    _check_layout(files, document, sample, shuffle)
    _check_documents(files["document_index.npy"], document, idx, len(lengths))
    _check_samples(files["sample_index.npy"], sample, document, lengths, extra,
                   description["sequence_length"])
    _check_shuffle(files["shuffle_index.npy"], shuffle, len(sample) - 1)
    if description["num_samples"] is not None and len(sample) - 1 < description["num_samples"]:
        raise CacheError(f"dataset index cache {files['sample_index.npy']} holds "
                         f"{len(sample) - 1} samples, its description asks for "
                         f"{description['num_samples']}: {_FIX}")


def _check_layout(files, document, sample, shuffle) -> None:
    for suffix, array, ndim, dtypes in (
            ("document_index.npy", document, 1, (numpy.int32,)),
            ("sample_index.npy", sample, 2, (numpy.int32, numpy.int64)),
            ("shuffle_index.npy", shuffle, 1, (numpy.uint32, numpy.int64))):
        names = " or ".join(numpy.dtype(t).name for t in dtypes)
        if array.dtype not in [numpy.dtype(t) for t in dtypes]:
            raise CacheError(f"dataset index cache {files[suffix]} holds {array.dtype} "
                             f"values, megatron-core writes {names}: {_FIX}")
        if array.ndim != ndim or (ndim == 2 and array.shape[1] != 2):
            want = "(samples + 1, 2)" if ndim == 2 else "1-D"
            raise CacheError(f"dataset index cache {files[suffix]} has shape {array.shape}, "
                             f"megatron-core writes {want}: {_FIX}")
    if len(sample) == 0:
        raise CacheError(f"dataset index cache {files['sample_index.npy']} has no rows, "
                         f"megatron-core writes one more than the samples: {_FIX}")
    if len(shuffle) != len(sample) - 1:
        raise CacheError(f"dataset index cache {files['shuffle_index.npy']} has {len(shuffle)} "
                         f"entries, but {files['sample_index.npy']} has {len(sample)} rows "
                         f"(one more than its samples): {_FIX}")


def _first(bad: numpy.ndarray) -> int:
    return int(numpy.flatnonzero(bad)[0])


def _check_documents(path: str, document, idx: str, count: int) -> None:
    for start in range(0, len(document), _CHUNK):
        chunk = document[start:start + _CHUNK]
        if chunk.min() < 0 or chunk.max() >= count:
            i = _first((chunk < 0) | (chunk >= count))
            raise CacheError(f"dataset index cache {path}: entry {start + i} is document "
                             f"{chunk[i]}, but {idx} holds documents 0 to {count - 1}: {_FIX}")


def _check_shuffle(path: str, shuffle, samples: int) -> None:
    for start in range(0, len(shuffle), _CHUNK):
        chunk = shuffle[start:start + _CHUNK]
        if chunk.min() < 0 or chunk.max() >= samples:
            i = _first((chunk < 0) | (chunk >= samples))
            raise CacheError(f"dataset index cache {path}: entry {start + i} is sample "
                             f"{chunk[i]}, but the sample index holds samples 0 to "
                             f"{samples - 1}: {_FIX}")


def _row(path: str, k: int, row) -> str:
    return f"dataset index cache {path}: row {k} is ({row[0]}, {row[1]})"


def _check_samples(path: str, sample, document, lengths, extra: int, seq: int) -> None:
    """Rows in range, in order, inside their documents, ``seq`` tokens apart (the last
    sample 1 to ``seq``). A row's token position is the tokens of the document positions
    before it plus its offset; those sums are taken over windows of at most ``_CHUNK``
    positions that only move forward (the rows are checked to be in order first), so every
    position's length is gathered once or twice."""
    rows, positions = len(sample), len(document)
    if tuple(int(v) for v in sample[0]) != (0, 0):
        raise CacheError(f"{_row(path, 0, sample[0])}, but megatron-core starts every sample "
                         f"index at (0, 0): {_FIX}")
    pos, before = 0, 0  # the tokens of document positions [0, pos)
    last = None  # (p, o, token position) of the previous chunk's last row
    for start in range(0, rows, _CHUNK):
        chunk = numpy.asarray(sample[start:start + _CHUNK], dtype=numpy.int64)
        p, o = chunk[:, 0], chunk[:, 1]
        bad = (p < 0) | (p >= positions) | (o < 0)
        if bad.any():
            i = _first(bad)
            what = (f"document position {p[i]} is outside the document index's {positions} "
                    "entries" if not 0 <= p[i] < positions else f"offset {o[i]} is negative")
            raise CacheError(f"{_row(path, start + i, chunk[i])}, but {what}: {_FIX}")
        # row k against row k - 1 (for the chunk's first row, the previous chunk's last)
        pp = numpy.concatenate(([last[0]], p)) if last else p
        oo = numpy.concatenate(([last[1]], o)) if last else o
        bad = (pp[1:] < pp[:-1]) | ((pp[1:] == pp[:-1]) & (oo[1:] < oo[:-1]))
        if bad.any():
            k = _first(bad)
            i = k if last else k + 1  # the row in the chunk
            raise CacheError(f"{_row(path, start + i, chunk[i])}, after row {start + i - 1} "
                             f"({pp[k]}, {oo[k]}): rows must not decrease: {_FIX}")
        flat = numpy.empty(len(p), numpy.int64)  # token position of each row
        size = numpy.empty(len(p), numpy.int64)  # length of the document it points into
        i = 0
        while i < len(p):  # the rows in document positions [p[i], p[i] + _CHUNK), a turn
            j = i + int(numpy.searchsorted(p[i:], p[i] + _CHUNK))
            while pos < p[i]:  # positions no row of the window starts in, a window at a time
                step = min(int(p[i]), pos + _CHUNK)
                before += int(lengths[document[pos:step]].sum(dtype=numpy.int64))
                pos = step
            lens = lengths[document[pos:int(p[j - 1]) + 1]].astype(numpy.int64)
            cum = numpy.concatenate(([0], numpy.cumsum(lens)))
            flat[i:j] = before + cum[p[i:j] - pos] + o[i:j]
            size[i:j] = lens[p[i:j] - pos]
            before, pos, i = before + int(cum[-2]), int(p[j - 1]), j
        bad = o + extra > size
        if start == 0:
            bad[0] = False  # row 0 is (0, 0), even when its document is empty
        if bad.any():
            i = _first(bad)
            beyond = " (and a sample reads one token past it)" if extra else ""
            raise CacheError(f"{_row(path, start + i, chunk[i])}, but document "
                             f"{document[p[i]]} at position {p[i]} has {size[i]} tokens: "
                             f"offset {o[i]}{beyond} is past its end: {_FIX}")
        spans = numpy.diff(flat, prepend=last[2]) if last else numpy.diff(flat)
        first_sample = start - 1 if last else start  # the sample spans[0] measures
        bad = spans != seq
        if start + len(p) == rows and len(spans):  # the last sample may be short (padded)
            bad[-1] = not 1 <= spans[-1] <= seq
        if bad.any():
            k = first_sample + _first(bad)
            raise CacheError(f"dataset index cache {path}: sample {k} (rows {k} to {k + 1}) "
                             f"spans {spans[k - first_sample]} tokens, but its description's "
                             f"sequence length is {seq}: {_FIX}")
        last = (int(p[-1]), int(o[-1]), int(flat[-1]))
