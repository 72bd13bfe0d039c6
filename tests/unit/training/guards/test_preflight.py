"""The checks every input gets before training: data, tokenizer files, index caches, outputs.

Each bad input must give one line that names the file and the fix, and no file may ever be
unpickled on the way (a crafted cache must not run code).
"""

from __future__ import annotations

import argparse
import os
import pickle
import struct

import numpy
import pytest

from megatron.sdp4bit.training.guards import preflight as pf
from megatron.sdp4bit.training.tokenizers import build_tokenizer
from tests.unit._gpt2_vocab import write_gpt2_vocab


def _dataset(tmp_path, docs=((1, 2, 3), (4, 5)), dtype=numpy.uint16) -> str:
    """A megatron-core .bin/.idx pair written by megatron-core's own builder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_a_good_dataset_passes(tmp_path):
    pf.check_indexed_dataset(_dataset(tmp_path), vocab_size=6)


def test_missing_prefix(tmp_path):
    prefix = str(tmp_path / "nope")
    with pytest.raises(pf.InputError) as err:
        pf.check_indexed_dataset(prefix, 10)
    assert str(err.value) == (f"--data-path {prefix}: {prefix}.idx does not exist: give the "
                              "prefix of a .bin/.idx pair written by tools/preprocess_data.py")


def test_truncated_bin(tmp_path):
    prefix = _dataset(tmp_path)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(pf.InputError, match=r"corpus.bin is 6 bytes but .*corpus.idx describes "
                                            r"5 tokens of 2 bytes \(10 bytes\): the pair does "
                                            "not match or one is truncated"):
        pf.check_indexed_dataset(prefix, 10)


@pytest.mark.parametrize("offset,value,match", [
    (0, b"XXIDIDX\x00\x00", "is not a megatron-core index \\(bad magic\\)"),
    (9, struct.pack("<Q", 7), "has index version 7, expected 1"),
    (17, struct.pack("<B", 42), "names token type code 42"),
    (18, struct.pack("<Q", 99), "but its header promises"),
], ids=["magic", "version", "dtype", "sizes"])
def test_corrupt_idx(tmp_path, offset, value, match):
    prefix = _dataset(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(value)
    with pytest.raises(pf.InputError, match=match):
        pf.check_indexed_dataset(prefix, 10)


def test_empty_dataset(tmp_path):
    prefix = _dataset(tmp_path, docs=())
    with pytest.raises(pf.InputError, match="holds no documents"):
        pf.check_indexed_dataset(prefix, 10)


def test_token_ids_beyond_the_vocabulary(tmp_path):
    prefix = _dataset(tmp_path, docs=((1, 2, 3), (4, 700)))
    with pytest.raises(pf.InputError) as err:
        pf.check_indexed_dataset(prefix, 512)
    assert str(err.value) == (f"{prefix}.bin holds token id 700 but the tokenizer has 512 "
                              "tokens: the data was made with another tokenizer; pass the "
                              "--tokenizer-type/--vocab-file it was made with")


def test_large_bins_are_sampled_and_still_see_bad_ids(tmp_path, monkeypatch):
    """Past FULL_SCAN_BYTES the check reads spread samples: an id past the vocabulary in
    every document (a wrong tokenizer) is still found; the file is not read in full."""
    monkeypatch.setattr(pf, "FULL_SCAN_BYTES", 4 * pf._CHUNK)
    monkeypatch.setattr(pf, "_CHUNK", 64)
    prefix = _dataset(tmp_path, docs=[(900,) * 100] * 10)
    with pytest.raises(pf.InputError, match="holds token id 900"):
        pf.check_indexed_dataset(prefix, 512)


# ------------------------------------------------------------------------ index caches


class _RunsCode:
    def __reduce__(self):
        return (open, (os.environ["SDP4BIT_TEST_MARKER"], "w"))


def test_numeric_cache_passes(tmp_path):
    path = tmp_path / "x-document_index.npy"
    numpy.save(path, numpy.arange(10, dtype=numpy.int32))
    pf.check_index_cache(str(path))


@pytest.mark.parametrize("kind", ["object-npy", "raw-pickle"])
def test_a_crafted_cache_is_refused_without_running_code(tmp_path, monkeypatch, kind):
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("SDP4BIT_TEST_MARKER", str(marker))
    path = tmp_path / "abc-GPTDataset-train-document_index.npy"
    if kind == "object-npy":
        numpy.save(path, numpy.array([_RunsCode()], dtype=object), allow_pickle=True)
        match = "holds Python objects, not numbers; megatron-core would unpickle it"
    else:
        path.write_bytes(pickle.dumps(_RunsCode()))
        match = "is not a NumPy array file"
    with pytest.raises(pf.InputError, match=match):
        pf.check_index_cache(str(path))
    assert not marker.exists()
    # numpy itself would have run it: the check is what stands between the file and that
    try:
        numpy.load(path, allow_pickle=True)
    except Exception:  # noqa: BLE001 - what numpy makes of the file after the code ran
        pass
    assert marker.exists()


def test_truncated_cache(tmp_path):
    path = tmp_path / "x.npy"
    numpy.save(path, numpy.arange(100, dtype=numpy.int64))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(pf.InputError, match="its header says .*: it is truncated"):
        pf.check_index_cache(str(path))


# ----------------------------------------------------------------- outputs and tokenizer


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(save=None, tensorboard_dir=None, data_cache_path=None, wandb_save_dir="",
                metrics_jsonl=None, mock_data=True, data_path=None,
                tokenizer_type="NullTokenizer", vocab_size=64, vocab_file=None,
                merge_file=None, tokenizer_model=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_unwritable_output_folder_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = str(blocker / "ckpt")
    with pytest.raises(pf.InputError) as err:
        pf.check_inputs(_args(tmp_path, save=target), build_tokenizer)
    assert str(err.value).startswith(f"--save {target} is not a writable folder (")


def test_metrics_path_that_is_a_folder(tmp_path):
    with pytest.raises(pf.InputError, match="is a folder: give a file path"):
        pf.check_inputs(_args(tmp_path, metrics_jsonl=str(tmp_path)), build_tokenizer)


def test_missing_and_wrong_tokenizer_files(tmp_path):
    vocab, merges = write_gpt2_vocab(tmp_path)
    args = _args(tmp_path, tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "no"),
                 merge_file=merges)
    with pytest.raises(pf.InputError, match=r"--vocab-file .*/no: no such file: check "
                                            "--tokenizer-type and its files"):
        pf.check_inputs(args, build_tokenizer)
    bad = tmp_path / "bad.json"
    bad.write_text("this is not json")
    args = _args(tmp_path, tokenizer_type="GPT2BPETokenizer", vocab_file=str(bad),
                 merge_file=merges)
    with pytest.raises(pf.InputError, match="cannot read GPT-2 BPE files"):
        pf.check_inputs(args, build_tokenizer)


def test_caches_of_the_run_are_checked(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "h-GPTDataset-train-shuffle_index.npy").write_bytes(b"\x80\x04not numpy")
    with pytest.raises(pf.InputError, match="shuffle_index.npy is not a NumPy array file"):
        pf.check_inputs(_args(tmp_path, data_cache_path=str(cache)), build_tokenizer)
