"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e import _launch
from tests.e2e.test_pretrain_gpt import ROOT, _env
from tests.unit._gpt2_vocab import TEXT, write_gpt2_vocab


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory) -> list[str]:
    """A GPT-2 BPE corpus through tools/preprocess_data.py, built once per session; returns
    the flags that use it. Tests must not change its files (copy them to break them)."""
    d = tmp_path_factory.mktemp("data")
    vocab, merges = write_gpt2_vocab(d)
    with open(d / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i in range(60):
            f.write(json.dumps({"text": " ".join(TEXT[(i + k) % len(TEXT)] for k in range(3))})
                    + "\n")
    res = _launch.python(os.path.join(ROOT, "tools", "preprocess_data.py"),
                         ["--input", str(d / "corpus.jsonl"), "--output-prefix",
                          str(d / "corpus"), "--tokenizer-type", "GPT2BPETokenizer",
                          "--vocab-file", vocab, "--merge-file", merges, "--append-eod"],
                         env=_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return ["--data-path", str(d / "corpus_text_document"), "--vocab-file", vocab,
            "--merge-file", merges, "--data-cache-path", str(d / "cache")]
