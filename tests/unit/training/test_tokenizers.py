"""Tokenizers: GPT-2 BPE on GPT-2-format files, SentencePiece, Null; vocab padding."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from megatron.sdp4bit.training.tokenizers import (
    GPT2BPETokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    padded_vocab_size,
)
from tests.helpers.corpora import TEXT, write_gpt2_vocab


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return write_gpt2_vocab(tmp_path_factory.mktemp("gpt2"))


def test_gpt2_round_trip_and_eod(gpt2_files):
    vocab, merges = gpt2_files
    tok = GPT2BPETokenizer(vocab, merges)
    with open(vocab, encoding="utf-8") as f:
        table = json.load(f)
    assert tok.vocab_size == len(table)
    assert tok.eod == table["<|endoftext|>"]
    for text in TEXT[:4] + ["  leading spaces and\nnew lines\t", "unseen: zebra 42 \u00e9"]:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    # Merges were learned: a frequent word takes fewer ids than its bytes.
    assert len(tok.tokenize(" the")) < len(" the".encode())


def test_gpt2_errors(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    with pytest.raises(ValueError, match="--vocab-file .*: no such file"):
        GPT2BPETokenizer(str(tmp_path / "missing.json"), merges)
    table = json.load(open(vocab, encoding="utf-8"))
    del table["<|endoftext|>"]
    no_eod = tmp_path / "v.json"
    no_eod.write_text(json.dumps(table), encoding="utf-8")
    with pytest.raises(ValueError, match=r"has no <\|endoftext\|> token"):
        GPT2BPETokenizer(str(no_eod), merges)


def test_sentencepiece_round_trip(tmp_path):
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=model, vocab_size=60,
        character_coverage=1.0, minloglevel=2)
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    tok = SentencePieceTokenizer(str(path))
    assert tok.vocab_size == 60
    ids = tok.tokenize("the quick brown fox")
    assert tok.detokenize(ids) == "the quick brown fox"
    assert tok.eod == 2  # sentencepiece's default </s> id


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("1 2  99") == [1, 2, 99]
    assert tok.detokenize([3, 4]) == "3 4"
    with pytest.raises(ValueError, match=r"ids \[100\] outside \[0, 100\)"):
        tok.tokenize("100")


def test_build_tokenizer_dispatch(gpt2_files):
    vocab, merges = gpt2_files
    ns = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                            merge_file=merges, tokenizer_model=None, vocab_size=None)
    assert isinstance(build_tokenizer(ns), GPT2BPETokenizer)
    ns.tokenizer_type, ns.vocab_size = "NullTokenizer", 7
    assert build_tokenizer(ns).vocab_size == 8


@pytest.mark.parametrize("n,div,tp,want", [(50257, 128, 1, 50304), (50257, 128, 2, 50432),
                                           (256, 128, 1, 256), (1, 8, 1, 8)],
                         ids=lambda v: str(v))
def test_padded_vocab_size(n, div, tp, want):
    assert padded_vocab_size(n, div, tp) == want


def test_the_registry_is_what_the_command_lines_offer_and_require():
    from megatron.sdp4bit.training.cli.arguments import TOKENIZER_TYPES, build_parser
    from megatron.sdp4bit.training.tokenizers import registry
    from tests.helpers.scripts import load_tool

    assert TOKENIZER_TYPES == tuple(registry.REGISTRY) == registry.names()
    for parser in (build_parser(), load_tool("tools/preprocess_data.py").build_parser()):
        action = next(a for a in parser._actions if a.dest == "tokenizer_type")
        assert tuple(action.choices) == registry.names()
    bare = argparse.Namespace(vocab_file=None, merge_file=None, tokenizer_model=None,
                              vocab_size=1)
    assert {name: spec.missing(bare) for name, spec in registry.REGISTRY.items()} == {
        "GPT2BPETokenizer": "--tokenizer-type GPT2BPETokenizer needs --vocab-file and "
                            "--merge-file",
        "SentencePieceTokenizer": "--tokenizer-type SentencePieceTokenizer needs "
                                  "--tokenizer-model",
        "NullTokenizer": "--tokenizer-type NullTokenizer needs --vocab-size N (N >= 2)"}
    assert registry.REGISTRY["NullTokenizer"].missing(
        argparse.Namespace(vocab_size=2)) is None
    with pytest.raises(ValueError, match="--tokenizer-type 'Bert': use GPT2BPETokenizer, "
                                         "SentencePieceTokenizer or NullTokenizer"):
        build_tokenizer(argparse.Namespace(tokenizer_type="Bert"))
