"""tools/preprocess_data.py: GPT-2 BPE jsonl -> .bin/.idx, read back through IndexedDataset."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.sdp4bit.training.tokenizers import GPT2BPETokenizer
from tests.helpers import launch as _launch
from tests.helpers.corpora import TEXT, write_gpt2_vocab
from tests.helpers.full_disk import full_disk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return write_gpt2_vocab(tmp_path_factory.mktemp("gpt2"))


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """``python tools/preprocess_data.py args``, forked from the session's fork server."""
    return _launch.python(TOOL, list(args), env=dict(os.environ), cwd=ROOT, timeout=120)


def tool_args(jsonl, prefix, vocab, merges, *extra: str) -> list[str]:
    return ["--input", str(jsonl), "--output-prefix", str(prefix), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, *extra]


@pytest.mark.parametrize("workers", [1, 2], ids=lambda w: f"workers{w}")
def test_tokens_round_trip(tmp_path, gpt2_files, workers):
    vocab, merges = gpt2_files
    docs = [{"text": t, "title": f"doc {i}"} for i, t in enumerate(TEXT[:4] + ["x" * 300])]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("\n".join(json.dumps(d) for d in docs[:3]) + "\n\n"
                     + "\n".join(json.dumps(d) for d in docs[3:]) + "\n", encoding="utf-8")
    res = run_tool(*tool_args(jsonl, tmp_path / "out", vocab, merges, "--json-keys", "text",
                              "title", "--append-eod", "--workers", str(workers),
                              "--log-interval", "2"))
    assert res.returncode == 0, res.stderr
    assert "processed 2 documents" in res.stderr and "processed 4 documents" in res.stderr
    tok = GPT2BPETokenizer(vocab, merges)
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"out_{key}_document"))
        assert len(ds) == len(docs)
        for i, doc in enumerate(docs):
            ids = ds[i].tolist()
            assert ids[-1] == tok.eod
            assert ids[:-1] == tok.tokenize(doc[key])
            assert tok.detokenize(ids[:-1]) == doc[key]
        assert list(ds.document_indices) == list(range(len(docs) + 1))


@pytest.mark.parametrize("line,message", [
    ('{"text": "ok"', "not valid JSON"),
    ('["text"]', "expected a JSON object, got list"),
    ('{"body": "x"}', "missing key 'text'"),
    ('{"text": 5}', "key 'text' holds int, not a string"),
], ids=["json", "array", "key", "type"])
def test_malformed_line_names_file_and_line(tmp_path, gpt2_files, line, message, capsys):
    vocab, merges = gpt2_files
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n\n' + line + "\n", encoding="utf-8")
    assert load_tool().main(tool_args(jsonl, tmp_path / "out", vocab, merges)) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"preprocess_data.py: error: {jsonl}:3: {message}")


def test_missing_vocab_is_one_line(tmp_path, gpt2_files):
    _, merges = gpt2_files
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "a"}\n', encoding="utf-8")
    res = run_tool(*tool_args(jsonl, tmp_path / "o", str(tmp_path / "nope.json"), merges))
    assert res.returncode == 1
    assert res.stderr.strip() == f"preprocess_data.py: error: --vocab-file {tmp_path}/nope.json: no such file"


def test_a_byte_that_is_not_utf8_names_its_file_line_and_column(tmp_path, gpt2_files, capsys):
    """The decoder's own error gave neither file nor line, and its position counted from the
    start of a read buffer."""
    vocab, merges = gpt2_files
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n' * 3 + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    assert load_tool().main(tool_args(jsonl, tmp_path / "out", vocab, merges)) == 1
    assert capsys.readouterr().err == (f"preprocess_data.py: error: {jsonl}:4: not UTF-8 (byte "
                                       "0xe9 at column 14)\n")
    assert os.listdir(tmp_path) == ["latin1.jsonl"]


def test_an_existing_pair_needs_overwrite_and_a_full_disk_leaves_nothing(tmp_path, gpt2_files,
                                                                         capsys):
    vocab, merges = gpt2_files
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT * 60),
                     encoding="utf-8")
    out = tmp_path / "out"
    tool = load_tool()
    assert tool.main(tool_args(jsonl, out, vocab, merges)) == 0
    assert tool.main(tool_args(jsonl, out, vocab, merges)) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"preprocess_data.py: error: --output-prefix {out}: {out}_text_document.bin exists: "
        "pass --overwrite to replace the pair, or choose another --output-prefix")
    assert tool.main(tool_args(jsonl, out, vocab, merges, "--overwrite")) == 0
    with full_disk(tmp_path, kib=64) as disk:
        # the tokens of this input (2 bytes each) take more than the 64 KiB
        assert os.path.getsize(f"{out}_text_document.bin") > 64 * 1024
        capsys.readouterr()
        assert tool.main(tool_args(jsonl, disk / "out", vocab, merges)) == 1
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"preprocess_data.py: error: cannot write --output-prefix {disk / 'out'} (No space "
            "left on device): free space or fix the folder; an existing pair is left as it was")
        assert os.listdir(disk) == []


def test_sentencepiece_tokenizers_keep_megatron_lms_ids(tmp_path):
    """Llama2Tokenizer starts every document with bos; Megatron-LM's SentencePieceTokenizer
    ends it with its own <EOD>, appended after the model's 300 pieces; TikTokenizer is one
    line."""
    import sentencepiece

    from tests.helpers.corpora import write_sentencepiece

    model = write_sentencepiece(tmp_path / "sp.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT[:3]), encoding="utf-8")
    for kind, first, eod in (("Llama2Tokenizer", [1], 2), ("SentencePieceTokenizer", [], 302)):
        res = run_tool("--input", str(jsonl), "--output-prefix", str(tmp_path / kind),
                       "--tokenizer-type", kind, "--tokenizer-model", model, "--append-eod")
        assert res.returncode == 0, res.stderr
        ds = IndexedDataset(str(tmp_path / f"{kind}_text_document"))
        assert [ds[i].tolist() for i in range(3)] == [first + sp.encode(t) + [eod]
                                                      for t in TEXT[:3]]
    res = run_tool("--input", str(jsonl), "--output-prefix", str(tmp_path / "tik"),
                   "--tokenizer-type", "TikTokenizer", "--tokenizer-model", model)
    assert res.returncode != 0 and res.stderr.splitlines()[-1].endswith(
        "--tokenizer-type TikTokenizer is not supported by this trainer: it needs the tiktoken "
        "package, which is not among this trainer's dependencies: use HuggingFaceTokenizer "
        "with the model's tokenizer folder")
    assert "Traceback" not in res.stderr
