"""The values inside megatron-core's dataset index caches, checked by the preflight.

The caches are megatron-core's own: the trainer's dataset builder writes them in-process (a
few hundredths of a second for these 30 documents); each test then damages one value the way
a stale, foreign or hand-edited cache would and expects the one-line refusal.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy
import pytest

from megatron.sdp4bit.training.cli.arguments import parse_args
from megatron.sdp4bit.training.data import build_datasets, dataset_config
from megatron.sdp4bit.training.guards import index_cache as ic
from megatron.sdp4bit.training.guards import preflight as pf
from megatron.sdp4bit.training.tokenizers import build_tokenizer
from tests.helpers.corpora import write_indexed_dataset as _dataset

# 50 train samples of 8 tokens from 24 documents of 1 to 13 tokens (162 tokens): three
# epochs, the last shuffled on its own (megatron-core's separate_final_epoch)
MODEL = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
         "--micro-batch-size 1 --train-iters 50 --lr 1e-3 --eval-interval 20 --eval-iters 2 "
         "--tokenizer-type NullTokenizer --vocab-size 64 --split 8,1,1").split()
LENGTHS = [(7 * i) % 13 + 1 for i in range(30)]
FIX = "delete it (it is rebuilt)"


def _corpus(folder, lengths=LENGTHS) -> str:
    folder.mkdir(exist_ok=True)
    return _dataset(folder, docs=[[(3 * i + j) % 60 + 1 for j in range(n)]
                                  for i, n in enumerate(lengths)])


def _build(prefix: str, *flags: str):
    """The run's arguments, after megatron-core built (and cached) its datasets."""
    args = parse_args(MODEL + ["--data-path", prefix, *flags], world_size=1)
    build_datasets(args, build_tokenizer(args))
    return args


def _files(folder, split="train") -> dict[str, str]:
    (files,) = [f for f in ic.cache_sets(str(folder))
                if f"-GPTDataset-{split}-" in os.path.basename(f["sample_index.npy"])]
    return files


def _edit(path: str, change) -> None:
    """Replace the array in ``path`` by ``change(a copy of it)``."""
    array = numpy.load(path)
    numpy.save(path, change(array.copy()))


def _rehash(files: dict[str, str], text: str) -> dict[str, str]:
    """Give the set the description ``text`` and the name megatron-core would give it."""
    new = hashlib.md5(text.encode()).hexdigest()
    with open(files["description.txt"], "w") as f:
        f.write(text)
    renamed = {}
    for suffix, path in files.items():
        folder, name = os.path.split(path)
        renamed[suffix] = os.path.join(folder, new + name[32:])
        os.rename(path, renamed[suffix])
    return renamed


@pytest.fixture
def run(tmp_path):
    prefix = _corpus(tmp_path / "data")
    args = _build(prefix)
    return args, prefix, _files(os.path.join(prefix, "cache", "GPTDataset_indices"))


def _refusal(args) -> str:
    with pytest.raises(pf.InputError) as err:
        pf.check_inputs(args, build_tokenizer)
    return str(err.value)


@pytest.mark.parametrize("chunk", [1 << 20, 1, 3], ids=["one-chunk", "chunk-1", "chunk-3"])
def test_caches_megatron_core_built_pass(run, monkeypatch, chunk):
    """Three splits, the train one over three epochs; in one chunk and in windows of 1 and 3
    entries (the chunked passes carry their sums and last row across chunks)."""
    args, prefix, files = run
    monkeypatch.setattr(ic, "_CHUNK", chunk)
    checked = []
    real = ic._check_samples
    monkeypatch.setattr(ic, "_check_samples", lambda path, *a: checked.append(path) or
                        real(path, *a))
    pf.check_inputs(args, build_tokenizer)
    assert len(checked) == 3 and files["sample_index.npy"] in checked
    document = numpy.load(files["document_index.npy"])
    assert len(document) == 3 * 24 and numpy.load(files["sample_index.npy"]).dtype == numpy.int32


def _inner_row(sample: numpy.ndarray) -> int:
    """A row whose document position differs from both neighbours', with an offset > 0."""
    return next(k for k in range(1, len(sample) - 1) if sample[k - 1, 0] < sample[k, 0]
                < sample[k + 1, 0] and sample[k, 1] > 0)


def _document_past_the_data(files, prefix):
    _edit(files["document_index.npy"], lambda a: (a.__setitem__(5, 30), a)[1])
    return (f"dataset index cache {files['document_index.npy']}: entry 5 is document 30, but "
            f"{prefix}.idx holds documents 0 to 29: {FIX}")


def _negative_document(files, prefix):
    _edit(files["document_index.npy"], lambda a: (a.__setitem__(0, -1), a)[1])
    return (f"dataset index cache {files['document_index.npy']}: entry 0 is document -1, but "
            f"{prefix}.idx holds documents 0 to 29: {FIX}")


def _position_past_the_document_index(files, prefix):
    sample = numpy.load(files["sample_index.npy"])
    n, o = len(numpy.load(files["document_index.npy"])), sample[3, 1]
    _edit(files["sample_index.npy"], lambda a: (a.__setitem__((3, 0), n), a)[1])
    return (f"dataset index cache {files['sample_index.npy']}: row 3 is ({n}, {o}), but "
            f"document position {n} is outside the document index's {n} entries: {FIX}")


def _negative_offset(files, prefix):
    sample = numpy.load(files["sample_index.npy"])
    p = sample[2, 0]
    _edit(files["sample_index.npy"], lambda a: (a.__setitem__((2, 1), -1), a)[1])
    return (f"dataset index cache {files['sample_index.npy']}: row 2 is ({p}, -1), but offset "
            f"-1 is negative: {FIX}")


def _offset_past_its_document(files, prefix):
    sample, document = (numpy.load(files[s]) for s in ("sample_index.npy",
                                                       "document_index.npy"))
    k = _inner_row(sample)
    p = sample[k, 0]
    d = document[p]
    size = LENGTHS[d]  # offset size - 1 is the last a sample may end at: it reads one more
    _edit(files["sample_index.npy"], lambda a: (a.__setitem__((k, 1), size), a)[1])
    return (f"dataset index cache {files['sample_index.npy']}: row {k} is ({p}, {size}), but "
            f"document {d} at position {p} has {size} tokens: offset {size} (and a sample "
            f"reads one token past it) is past its end: {FIX}")


def _decreasing_rows(files, prefix):
    sample = numpy.load(files["sample_index.npy"])
    k = 4
    _edit(files["sample_index.npy"], lambda a: a[[*range(k), k + 1, k, *range(k + 2, len(a))]])
    (p0, o0), (p1, o1) = sample[k], sample[k + 1]
    return (f"dataset index cache {files['sample_index.npy']}: row {k + 1} is ({p0}, {o0}), "
            f"after row {k} ({p1}, {o1}): rows must not decrease: {FIX}")


def _sample_of_another_length(files, prefix):
    sample = numpy.load(files["sample_index.npy"])
    k = _inner_row(sample)
    _edit(files["sample_index.npy"], lambda a: (a.__setitem__((k, 1), a[k, 1] - 1), a)[1])
    return (f"dataset index cache {files['sample_index.npy']}: sample {k - 1} (rows {k - 1} to "
            f"{k}) spans 7 tokens, but its description's sequence length is 8: {FIX}")


def _first_row_not_at_the_start(files, prefix):
    _edit(files["sample_index.npy"], lambda a: (a.__setitem__((0, 1), 1), a)[1])
    return (f"dataset index cache {files['sample_index.npy']}: row 0 is (0, 1), but "
            f"megatron-core starts every sample index at (0, 0): {FIX}")


def _shuffle_past_the_samples(files, prefix):
    n = len(numpy.load(files["shuffle_index.npy"]))
    _edit(files["shuffle_index.npy"], lambda a: (a.__setitem__(4, n), a)[1])
    return (f"dataset index cache {files['shuffle_index.npy']}: entry 4 is sample {n}, but the "
            f"sample index holds samples 0 to {n - 1}: {FIX}")


def _shuffle_of_another_length(files, prefix):
    n = len(numpy.load(files["shuffle_index.npy"]))
    _edit(files["shuffle_index.npy"], lambda a: a[:-1])
    return (f"dataset index cache {files['shuffle_index.npy']} has {n - 1} entries, but "
            f"{files['sample_index.npy']} has {n + 1} rows (one more than its samples): {FIX}")


def _dtype(suffix, dtype, names):
    def case(files, prefix):
        _edit(files[suffix], lambda a: a.astype(dtype))
        return (f"dataset index cache {files[suffix]} holds {numpy.dtype(dtype).name} values, "
                f"megatron-core writes {names}: {FIX}")
    return case


def _shape(suffix, change, names):
    def case(files, prefix):
        _edit(files[suffix], change)
        shape = numpy.load(files[suffix]).shape
        return (f"dataset index cache {files[suffix]} has shape {shape}, megatron-core writes "
                f"{names}: {FIX}")
    return case


def _sample_without_rows(files, prefix):
    _edit(files["sample_index.npy"], lambda a: a[:0])
    return (f"dataset index cache {files['sample_index.npy']} has no rows, megatron-core "
            f"writes one more than the samples: {FIX}")


def _edited_description(files, prefix):
    with open(files["description.txt"], "a") as f:
        f.write(" ")
    name = os.path.basename(files["description.txt"])[:32]
    return (f"dataset index cache {files['description.txt']} does not hash to the {name} its "
            f"name carries (edited, or renamed from another set), so its arrays belong to no "
            f"known data: {FIX}")


def _fewer_samples_than_described(files, prefix):
    description = json.load(open(files["description.txt"]))
    description["num_samples"] = 1000
    files.update(_rehash(files, json.dumps(description, indent=4)))
    n = len(numpy.load(files["shuffle_index.npy"]))
    return (f"dataset index cache {files['sample_index.npy']} holds {n} samples, its "
            f"description asks for 1000: {FIX}")


def _not_a_description(files, prefix):
    files.update(_rehash(files, '{"dataset_path": "elsewhere"}'))
    return (f"dataset index cache {files['description.txt']} is not a GPTDataset description "
            f"(JSON with dataset_path, num_samples, sequence_length): {FIX}")


CASES = {
    "document-past-the-data": _document_past_the_data,
    "negative-document": _negative_document,
    "position-past-the-document-index": _position_past_the_document_index,
    "negative-offset": _negative_offset,
    "offset-past-its-document": _offset_past_its_document,
    "decreasing-rows": _decreasing_rows,
    "sample-of-another-length": _sample_of_another_length,
    "first-row-not-at-the-start": _first_row_not_at_the_start,
    "shuffle-past-the-samples": _shuffle_past_the_samples,
    "shuffle-of-another-length": _shuffle_of_another_length,
    "sample-without-rows": _sample_without_rows,
    "document-int64": _dtype("document_index.npy", numpy.int64, "int32"),
    "sample-float": _dtype("sample_index.npy", numpy.float64, "int32 or int64"),
    "shuffle-int32": _dtype("shuffle_index.npy", numpy.int32, "uint32 or int64"),
    "sample-flat": _shape("sample_index.npy", lambda a: a.reshape(-1), "(samples + 1, 2)"),
    "sample-3-columns": _shape("sample_index.npy", lambda a: numpy.pad(a, ((0, 0), (0, 1))),
                               "(samples + 1, 2)"),
    "document-2d": _shape("document_index.npy", lambda a: a.reshape(-1, 2), "1-D"),
    "edited-description": _edited_description,
    "fewer-samples-than-described": _fewer_samples_than_described,
    "not-a-description": _not_a_description,
}


@pytest.mark.parametrize("chunk", [1 << 20, 3], ids=["one-chunk", "chunk-3"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_broken_invariant_is_one_line(run, monkeypatch, case, chunk):
    args, prefix, files = run
    monkeypatch.setattr(ic, "_CHUNK", chunk)
    expected = CASES[case](files, prefix)  # damages the set
    assert _refusal(args) == expected


def test_an_incomplete_set_is_left_to_megatron_core_which_rebuilds_it(run):
    """megatron-core takes a set as a hit only with all four files; without one it builds
    the indices again and overwrites the others, so the preflight leaves such a set alone."""
    args, prefix, files = run
    _edit(files["document_index.npy"], lambda a: a + 100)
    assert "is document 1" in _refusal(args)
    os.remove(files["description.txt"])
    pf.check_inputs(args, build_tokenizer)
    _build(prefix)
    assert os.path.isfile(files["description.txt"])
    assert numpy.load(files["document_index.npy"]).max() < 24
    pf.check_inputs(args, build_tokenizer)


def test_a_mock_data_run_leaves_gptdataset_sets_alone(run):
    """With --mock-data megatron-core builds MockGPTDataset sets and never opens a
    GPTDataset one, even in its --data-cache-path."""
    args, prefix, files = run
    _edited_description(files, prefix)
    folder = os.path.dirname(files["description.txt"])
    mock = parse_args(MODEL + ["--mock-data", "--data-cache-path", folder], world_size=1)
    pf.check_inputs(mock, build_tokenizer)
    mock.mock_data, mock.data_path = False, [prefix]
    assert "does not hash to the" in _refusal(mock)


def test_without_the_extra_token_an_offset_may_reach_the_documents_end(tmp_path):
    """With add_extra_token_to_sequence off, megatron-core ends a sample at a document's end
    (offset = its length); that passes for such a run and is refused for this trainer's, which
    reads one token past each sample's end offset (megatron-core's default, kept)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset

    prefix = _corpus(tmp_path / "data")
    args = parse_args(MODEL + ["--data-path", prefix], world_size=1)
    config = dataset_config(args, build_tokenizer(args))
    assert config.add_extra_token_to_sequence is True and ic.EXTRA_TOKEN == 1
    config.add_extra_token_to_sequence = False
    BlendedMegatronDatasetBuilder(GPTDataset, [50, 6, 2], lambda: True, config).build()
    files = _files(os.path.join(prefix, "cache", "GPTDataset_indices"))
    sample, document = (numpy.load(files[s]) for s in ("sample_index.npy",
                                                       "document_index.npy"))
    lengths = numpy.array(LENGTHS, dtype=numpy.int32)
    at_end = [k for k in range(1, len(sample)) if sample[k, 1] == lengths[document[sample[k, 0]]]]
    assert at_end
    data = {prefix: (prefix + ".idx", lengths)}
    ic.check_cache_set(files, data, extra=0)
    with pytest.raises(ic.CacheError) as err:
        ic.check_cache_set(files, data)
    k = at_end[0]
    assert str(err.value) == (
        f"dataset index cache {files['sample_index.npy']}: row {k} is ({sample[k, 0]}, "
        f"{sample[k, 1]}), but document {document[sample[k, 0]]} at position {sample[k, 0]} has "
        f"{sample[k, 1]} tokens: offset {sample[k, 1]} (and a sample reads one token past it) "
        f"is past its end: {FIX}")


def test_a_cache_of_another_prefix_is_ignored_one_relabelled_as_ours_is_checked(tmp_path):
    """In a shared --data-cache-path, a set names its prefix in its description and through
    the description in its hash: a run on another prefix never opens it (megatron-core builds
    its own), so it is not checked; relabelled as this run's prefix, it is checked against
    this run's data."""
    cache = str(tmp_path / "cache")
    big = _corpus(tmp_path / "big")
    small = _corpus(tmp_path / "small", LENGTHS[:10])
    _build(big, "--data-cache-path", cache)
    foreign = _files(cache)
    _edit(foreign["sample_index.npy"], lambda a: (a.__setitem__((3, 0), 10 ** 6), a)[1])
    args = parse_args(MODEL + ["--data-path", small, "--data-cache-path", cache], world_size=1)
    pf.check_inputs(args, build_tokenizer)  # the big corpus's sets are not this run's
    _build(small, "--data-cache-path", cache)
    assert len(ic.cache_sets(cache)) == 6  # megatron-core built its own three beside them
    pf.check_inputs(args, build_tokenizer)
    description = json.load(open(foreign["description.txt"]))
    description["dataset_path"] = small
    foreign = _rehash(foreign, json.dumps(description, indent=4))
    document = numpy.load(foreign["document_index.npy"])
    i = int(numpy.flatnonzero(document >= 10)[0])
    assert _refusal(args) == (f"dataset index cache {foreign['document_index.npy']}: entry {i} "
                              f"is document {document[i]}, but {small}.idx holds documents 0 "
                              f"to 9: {FIX}")


def test_a_relative_prefix_is_matched_as_the_run_passes_it(tmp_path, monkeypatch):
    """A description holds the prefix as its run typed it (here relative): a run typing the
    same string reads the set, and it is checked against that run's files; a run typing the
    absolute path gets another hash, and megatron-core builds it a set of its own."""
    _corpus(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    args = _build("data/corpus")
    folder = tmp_path / "data" / "corpus" / "cache" / "GPTDataset_indices"
    files = _files(folder)
    assert json.load(open(files["description.txt"]))["dataset_path"] == "data/corpus"
    _edit(files["document_index.npy"], lambda a: (a.__setitem__(2, 99), a)[1])
    assert _refusal(args) == (f"dataset index cache {files['document_index.npy']}: entry 2 is "
                              f"document 99, but data/corpus.idx holds documents 0 to 29: {FIX}")
    absolute = _build(str(tmp_path / "data" / "corpus"))
    assert len(ic.cache_sets(str(folder))) == 6
    pf.check_inputs(absolute, build_tokenizer)


def _valid_set(folder, rng):
    """A set as megatron-core builds it (its own helpers), for random data and settings."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    lengths = rng.integers(0, 12, int(rng.integers(3, 25))).astype(numpy.int32)
    lengths[0] = max(lengths[0], 3)
    seq, extra, epochs = int(rng.integers(2, 10)), int(rng.integers(0, 2)), int(rng.integers(1, 4))
    state = numpy.random.RandomState(int(rng.integers(1 << 30)))
    document = _build_document_index(numpy.arange(len(lengths)), epochs, state, False)
    total = int(lengths.sum())
    try:  # drop_last_partial_sequence off may end on an empty document: megatron-core asserts
        sample = helpers.build_sample_idx(lengths, document, seq, epochs, total,
                                          bool(rng.integers(0, 2)), extra)
    except AssertionError:
        sample = helpers.build_sample_idx(lengths, document, seq, epochs, total, True, extra)
    shuffle = _build_shuffle_index(len(sample) - 1, len(sample) - 1, state)
    text = json.dumps({"dataset_path": "p", "num_samples": None, "sequence_length": seq})
    base = os.path.join(folder, hashlib.md5(text.encode()).hexdigest() + "-GPTDataset-train-")
    with open(base + "description.txt", "w") as f:
        f.write(text)
    for name, array in (("document", document), ("sample", sample), ("shuffle", shuffle)):
        numpy.save(f"{base}{name}_index.npy", array)
    return ic.cache_sets(folder)[0], lengths, extra


def _reference(files, lengths, extra) -> bool:
    """The invariants, entry by entry in Python: whether the set is sound."""
    document, sample, shuffle = (numpy.load(files[s]).tolist() for s in ic.SUFFIXES[1:])
    if any(not 0 <= d < len(lengths) for d in document) or sample[0] != [0, 0]:
        return False
    seq = json.load(open(files["description.txt"]))["sequence_length"]
    before = [0]  # tokens of the document positions before each one
    for d in document:
        before.append(before[-1] + int(lengths[d]))
    flat = []
    for k, (p, o) in enumerate(sample):
        if not 0 <= p < len(document) or o < 0 or (k and o + extra > lengths[document[p]]):
            return False
        flat.append(before[p] + o)
    spans = [b - a for a, b in zip(flat, flat[1:])]
    return (all(s == seq for s in spans[:-1]) and (not spans or 1 <= spans[-1] <= seq)
            and all(0 <= j < len(spans) for j in shuffle))


def test_random_sets_agree_with_an_entry_by_entry_reading(tmp_path, monkeypatch):
    """Sets megatron-core's helpers build from random lengths (empty documents, one to three
    epochs, with and without the extra token) pass in any chunk size; one random value
    changed, the chunked check refuses exactly when the plain reading finds a fault."""
    rng = numpy.random.default_rng(7)
    refused = 0
    for case in range(120):
        folder = tmp_path / str(case)
        folder.mkdir()
        files, lengths, extra = _valid_set(str(folder), rng)
        data = {"p": ("p.idx", lengths)}
        monkeypatch.setattr(ic, "_CHUNK", int(rng.choice([1, 2, 3, 7, 1 << 20])))
        ic.check_cache_set(files, data, extra)
        suffix = ic.SUFFIXES[1 + case % 3]
        array = numpy.load(files[suffix])
        if array.size == 0:
            continue
        flat, at = array.reshape(-1), int(rng.integers(array.size))
        flat[at] = numpy.array(int(flat[at]) + int(rng.choice([-2, -1, 1, 2, 5]))).astype(
            array.dtype)  # uint32 wraps below 0, as a corrupt file would hold
        numpy.save(files[suffix], array)
        sound = _reference(files, lengths, extra)
        try:
            ic.check_cache_set(files, data, extra)
            assert sound, (case, suffix)
        except ic.CacheError:
            assert not sound, (case, suffix)
            refused += 1
    assert refused > 60
