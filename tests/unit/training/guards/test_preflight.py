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
from tests.helpers.corpora import write_gpt2_vocab, write_indexed_dataset as _dataset


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


# ----------------------------------------------------- token values, splits, unreadable files


@pytest.mark.parametrize("dtype", [numpy.int8, numpy.int16, numpy.int32])
def test_negative_token_ids_are_refused(tmp_path, dtype):
    prefix = _dataset(tmp_path, docs=((1, 2, 3), (4, -3)), dtype=dtype)
    with pytest.raises(pf.InputError) as err:
        pf.check_indexed_dataset(prefix, 512)
    assert str(err.value) == (f"{prefix}.bin holds token id -3 (negative): the file is corrupt "
                              "or was written with the wrong token type; rebuild it")


def test_fractional_token_ids_are_refused(tmp_path):
    prefix = _dataset(tmp_path, docs=((1.0, 2.5), (4.0,)), dtype=numpy.float32)
    with pytest.raises(pf.InputError) as err:
        pf.check_indexed_dataset(prefix, 512)
    assert str(err.value) == (f"{prefix}.bin holds token id 2.5 (not an integer): the file is "
                              "corrupt; rebuild it with tools/preprocess_data.py")


def test_documents_without_tokens(tmp_path):
    prefix = _dataset(tmp_path, docs=((), ()))
    assert os.path.getsize(prefix + ".bin") == 0  # numpy.memmap would raise on it
    with pytest.raises(pf.InputError) as err:
        pf.check_indexed_dataset(prefix, 512)
    assert str(err.value) == (f"--data-path {prefix} holds documents but no tokens: check the "
                              "input of tools/preprocess_data.py")


def test_an_unreadable_index_is_one_line(tmp_path, monkeypatch):
    import builtins
    import errno

    prefix = _dataset(tmp_path)
    real_open = builtins.open

    def guarded(path, *a, **k):
        if str(path).endswith(".idx"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded)
    with pytest.raises(pf.InputError) as err:
        pf.check_indexed_dataset(prefix, 512)
    assert str(err.value) == (f"--data-path {prefix}: cannot read {prefix}.idx (Permission "
                              "denied): fix its permissions")


def test_a_split_without_documents_is_refused_before_megatron_core_spins(tmp_path):
    """20 documents and --split 949,50,1: megatron-core gives the test split documents
    [round(0.999 x 20), round(1.0 x 20)) = [20, 20), none; its sample loop never ends."""
    prefix = _dataset(tmp_path, docs=[(1, 2, 3)] * 20)
    from megatron.sdp4bit.training.cli.validate import parse_split

    with pytest.raises(pf.InputError) as err:
        pf.check_indexed_dataset(prefix, 512, split=("949,50,1", parse_split("949,50,1")))
    assert str(err.value) == (f"--split 949,50,1 gives the test split of --data-path {prefix} "
                              "0 of its 20 documents (0 tokens), and megatron-core would wait "
                              "forever for its samples: give that split a larger share or 0, "
                              "or use more data")
    pf.check_indexed_dataset(prefix, 512, split=("949,50,0", parse_split("949,50,0")))  # no test
    pf.check_indexed_dataset(prefix, 512, split=("90,5,5", parse_split("90,5,5")))  # 18, 1, 1


def test_every_blend_component_split_is_checked(tmp_path):
    big = _dataset(tmp_path, docs=[(1, 2)] * 1000)  # its test split: document 999
    (tmp_path / "small").mkdir()
    small = _dataset(tmp_path / "small", docs=[(3,)] * 20)
    args = _args(tmp_path, mock_data=False, data_path=["0.5", big, "0.5", small],
                 split="949,50,1", split_vector=[0.949, 0.05, 0.001])
    with pytest.raises(pf.InputError, match=f"the test split of --data-path {small} 0 of its "
                                            "20 documents"):
        pf.check_inputs(args, build_tokenizer)


def test_the_cache_folder_megatron_core_reads_is_checked(tmp_path, monkeypatch):
    """Without --data-cache-path megatron-core reads <prefix>/cache/GPTDataset_indices of
    every blend component (not a cache/ folder beside the prefix); with it, only that
    folder."""
    from megatron.core.datasets import gpt_dataset

    monkeypatch.setenv("SDP4BIT_TEST_MARKER", str(tmp_path / "code-ran"))
    first = _dataset(tmp_path)
    (tmp_path / "b").mkdir()
    second = _dataset(tmp_path / "b")
    args = _args(tmp_path, mock_data=False, data_path=["1", first, "2", second])
    assert pf.index_cache_dirs(args) == [f"{p}/cache/GPTDataset_indices" for p in (first, second)]
    # the folder megatron-core itself names, read from its source
    assert 'self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices"' in \
        open(gpt_dataset.__file__).read()
    evil = os.path.join(second, "cache", "GPTDataset_indices", "h-GPTDataset-train-"
                        "document_index.npy")
    os.makedirs(os.path.dirname(evil))
    with open(evil, "wb") as f:
        f.write(pickle.dumps(_RunsCode()))
    with pytest.raises(pf.InputError, match=f"dataset index cache {evil} is not a NumPy array"):
        pf.check_inputs(args, build_tokenizer)
    own = tmp_path / "own-cache"
    args.data_cache_path = str(own)
    assert pf.index_cache_dirs(args) == [str(own)]
    pf.check_inputs(args, build_tokenizer)  # megatron-core will not read the other folder
    (own / "h-GPTDataset-valid-sample_index.npy").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(pf.InputError, match="valid-sample_index.npy is not a NumPy array"):
        pf.check_inputs(args, build_tokenizer)
    assert not (tmp_path / "code-ran").exists()


def test_a_read_only_dataset_folder_names_data_cache_path(tmp_path):
    """megatron-core writes its index cache beside the data by default: in a read-only
    dataset folder rank 0 failed with a traceback and the other ranks lost it after 62 s."""
    import contextlib
    import shutil
    import subprocess

    folder = tmp_path / "ro"
    folder.mkdir()
    with contextlib.ExitStack() as stack:
        if os.geteuid() == 0:  # root writes through permissions: a read-only mount instead
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs",
                            str(folder)],
                           check=True)
            # lazily: the failed check's traceback may still map the .idx
            stack.callback(subprocess.run, ["umount", "-l", str(folder)], check=True)
        prefix = _dataset(folder)
        if os.geteuid() == 0:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        else:
            folder.chmod(0o555)
            stack.callback(folder.chmod, 0o755)
        args = _args(tmp_path, mock_data=False, data_path=[prefix])
        with pytest.raises(pf.InputError) as err:
            pf.check_inputs(args, build_tokenizer)
        cache = f"{prefix}/cache/GPTDataset_indices"
        assert str(err.value) in (
            f"megatron-core writes its dataset index cache beside the data, in {cache}, and "
            f"that cannot be written ({why}): pass --data-cache-path a writable folder of "
            "yours" for why in ("Read-only file system", "Permission denied"))
        args.data_cache_path = str(tmp_path / "cache")
        pf.check_inputs(args, build_tokenizer)
        shutil.rmtree(tmp_path / "cache")
