"""Tokenizers: GPT-2 BPE on GPT-2-format files, SentencePiece under Megatron-LM's three
names, a Hugging Face tokenizer folder, Null; the registry; vocab padding."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from megatron.sdp4bit.training.tokenizers import (
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    padded_vocab_size,
)
from tests.helpers.corpora import TEXT, write_gpt2_vocab, write_hf_tokenizer, write_sentencepiece


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


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    """A 300-piece Llama-like SentencePiece model: <unk>, <s>, </s> = 0, 1, 2, no pad."""
    return write_sentencepiece(tmp_path_factory.mktemp("sp") / "sp.model")


def test_gpt_sentencepiece_and_llama2_are_the_models_pieces(sp_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    gpt, llama = GPTSentencePieceTokenizer(sp_model), Llama2Tokenizer(sp_model)
    text = "the quick brown fox"
    for tok in (gpt, llama):
        assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (300, 2, 1, None)
    assert gpt.tokenize(text) == sp.encode(text)
    assert llama.tokenize(text) == [1] + sp.encode(text)  # Llama 2 starts every text with bos
    assert gpt.detokenize(gpt.tokenize(text)) == llama.detokenize(llama.tokenize(text)) == text


def test_sentencepiece_tokenizer_is_megatron_lms_with_its_added_pieces(sp_model):
    """Megatron-LM's SentencePieceTokenizer appends <CLS>, <SEP>, <EOD>, <MASK> and, the model
    having no pad piece, <PAD> after the 300 pieces; its <s> and </s> are the model's."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tok = SentencePieceTokenizer(sp_model)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (305, 302, 1, 304)
    ids = tok.tokenize("the fox<EOD>a dog<CLS></s>")
    assert ids == sp.encode("the fox") + [302] + sp.encode("a dog") + [300, 2]
    assert tok.detokenize(ids) == "the fox <EOD> a dog <CLS>  </s> "


def test_sentencepiece_refusals(tmp_path):
    no_eos = write_sentencepiece(tmp_path / "no_eos.model", eos_id=-1)
    with pytest.raises(ValueError, match="defines no eos piece to end documents"):
        GPTSentencePieceTokenizer(no_eos)
    no_bos = write_sentencepiece(tmp_path / "no_bos.model", bos_id=-1)
    assert GPTSentencePieceTokenizer(no_bos).bos is None
    with pytest.raises(ValueError, match="defines no bos piece, which Llama2Tokenizer puts "
                                         "before every text"):
        Llama2Tokenizer(no_bos)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    return write_hf_tokenizer(tmp_path_factory.mktemp("hf"))


def test_huggingface_tokenizer_reads_a_local_folder(hf_folder, tmp_path):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(hf_folder, local_files_only=True)
    tok = HuggingFaceTokenizer(hf_folder)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (len(theirs), 2, 1, 0)
    for text in TEXT[:4]:
        assert tok.tokenize(text) == theirs(text).input_ids
        assert tok.detokenize(tok.tokenize(text)) == text
    with pytest.raises(ValueError, match="--tokenizer-model .*: not a folder"):
        HuggingFaceTokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="holds no tokenizer files"):
        HuggingFaceTokenizer(str(tmp_path))
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = open(os.path.join(hf_folder, name), encoding="utf-8").read()
        (no_eos / name).write_text(text, encoding="utf-8")
    config = json.loads((no_eos / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (no_eos / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="defines no eos token to end documents"):
        HuggingFaceTokenizer(str(no_eos))


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

    assert TOKENIZER_TYPES == tuple(registry.REGISTRY) == registry.names() == (
        "GPT2BPETokenizer", "HuggingFaceTokenizer", "GPTSentencePieceTokenizer",
        "Llama2Tokenizer", "SentencePieceTokenizer", "TikTokenizer", "NullTokenizer")
    for parser in (build_parser(), load_tool("tools/preprocess_data.py").build_parser()):
        action = next(a for a in parser._actions if a.dest == "tokenizer_type")
        assert tuple(action.choices) == registry.names()
    bare = argparse.Namespace(vocab_file=None, merge_file=None, tokenizer_model=None,
                              vocab_size=1)
    model = "needs --tokenizer-model"
    tiktoken = ("--tokenizer-type TikTokenizer is not supported by this trainer: it needs the "
                "tiktoken package, which is not among this trainer's dependencies: use "
                "HuggingFaceTokenizer with the model's tokenizer folder")
    assert {name: spec.missing(bare) for name, spec in registry.REGISTRY.items()} == {
        "GPT2BPETokenizer": "--tokenizer-type GPT2BPETokenizer needs --vocab-file and "
                            "--merge-file",
        "HuggingFaceTokenizer": f"--tokenizer-type HuggingFaceTokenizer {model}",
        "GPTSentencePieceTokenizer": f"--tokenizer-type GPTSentencePieceTokenizer {model}",
        "Llama2Tokenizer": f"--tokenizer-type Llama2Tokenizer {model}",
        "SentencePieceTokenizer": f"--tokenizer-type SentencePieceTokenizer {model}",
        "TikTokenizer": tiktoken,
        "NullTokenizer": "--tokenizer-type NullTokenizer needs --vocab-size N (N >= 2)"}
    assert registry.REGISTRY["NullTokenizer"].missing(
        argparse.Namespace(vocab_size=2)) is None
    given = argparse.Namespace(tokenizer_type="TikTokenizer", tokenizer_model="m.json")
    assert registry.REGISTRY["TikTokenizer"].missing(given) == tiktoken
    with pytest.raises(ValueError) as err:
        build_tokenizer(given)
    assert str(err.value) == tiktoken
    with pytest.raises(ValueError, match="--tokenizer-type 'Bert': use GPT2BPETokenizer, "
                                         "HuggingFaceTokenizer, .*, TikTokenizer or "
                                         "NullTokenizer"):
        build_tokenizer(argparse.Namespace(tokenizer_type="Bert"))


def test_the_manifests_record_rebuilds_the_same_tokenizer_or_says_why_not(
        gpt2_files, hf_folder, sp_model, tmp_path):
    import shutil

    from megatron.sdp4bit.training.tokenizers import registry

    vocab, merges = gpt2_files
    folder = shutil.copytree(hf_folder, tmp_path / "hf")
    cases = {"GPT2BPETokenizer": (dict(vocab_file=vocab, merge_file=merges), TEXT[0]),
             "HuggingFaceTokenizer": (dict(tokenizer_model=str(folder)), TEXT[0]),
             "Llama2Tokenizer": (dict(tokenizer_model=sp_model), TEXT[0]),
             "NullTokenizer": (dict(vocab_size=9), "1 2 8")}
    for name, (flags, text) in cases.items():
        args = argparse.Namespace(tokenizer_type=name, **flags)
        tok = build_tokenizer(args)
        saved = json.loads(json.dumps(registry.record(args, tok)))  # as the manifest holds it
        assert (saved["type"], saved["vocab_size"], saved["eod"], saved["bos"],
                saved["pad"]) == (name, tok.vocab_size, tok.eod, tok.bos, tok.pad)
        again = registry.from_record(saved)
        assert type(again) is type(tok) and again.tokenize(text) == tok.tokenize(text)
    assert list(saved["sha256"]) == [] and saved["args"] == {"vocab_size": 9}
    args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer",
                              tokenizer_model=str(folder))
    saved = registry.record(args, build_tokenizer(args))
    assert sorted(saved["sha256"]) == [str(folder / "tokenizer.json"),
                                       str(folder / "tokenizer_config.json")]
    with open(folder / "tokenizer.json", "a", encoding="utf-8") as f:
        f.write(" ")
    with pytest.raises(ValueError) as err:
        registry.from_record(saved)
    assert str(err.value) == (f"its file {folder / 'tokenizer.json'} changed since the "
                              "checkpoint was written")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=f"its file {folder / 'tokenizer.json'} is gone"):
        registry.from_record(saved)


GIANT = 8 << 30  # a sparse file: no disk taken, but read whole it would take 8 GiB


def _bad_tokenizers(d, gpt2_files, hf_folder, sp_model) -> dict:
    """Each malformed or giant tokenizer file, as the flags of the tokenizer that reads it
    and the Hugging Face folder an import reads it in (kind, flags, folder)."""
    import random
    import shutil

    vocab, merges = gpt2_files
    cases = {}

    def gpt2(name: str, vocab_bytes: bytes | None, merges_bytes: bytes | None) -> None:
        folder = d / name
        folder.mkdir()
        for path, source, data in ((folder / "vocab.json", vocab, vocab_bytes),
                                   (folder / "merges.txt", merges, merges_bytes)):
            shutil.copyfile(source, path) if data is None else path.write_bytes(data)
        (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
        cases[name] = ("GPT2BPETokenizer", dict(vocab_file=str(folder / "vocab.json"),
                                                merge_file=str(folder / "merges.txt")), folder)

    gpt2("vocab_not_json", b"{not json", None)
    gpt2("merges_garbage", None, random.Random(0).randbytes(5000))
    gpt2("vocab_giant", b"", None)
    os.truncate(d / "vocab_giant" / "vocab.json", GIANT)
    for name in ("tokenizer_json_truncated", "tokenizer_json_giant"):
        folder = shutil.copytree(hf_folder, d / name)
        data = (folder / "tokenizer.json").read_bytes()
        (folder / "tokenizer.json").write_bytes(data[:len(data) // 2])
        cases[name] = ("HuggingFaceTokenizer", dict(tokenizer_model=str(folder)), folder)
    os.truncate(d / "tokenizer_json_giant" / "tokenizer.json", GIANT)
    for name, size in (("sentencepiece_random", 20000), ("sentencepiece_giant", GIANT)):
        folder = d / name
        folder.mkdir()
        (folder / "tokenizer.model").write_bytes(random.Random(1).randbytes(20000))
        os.truncate(folder / "tokenizer.model", size)
        (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
        cases[name] = ("GPTSentencePieceTokenizer",
                       dict(tokenizer_model=str(folder / "tokenizer.model")), folder)
    return cases


def test_giant_or_malformed_files_are_one_line_in_every_tokenizer_path(
        gpt2_files, hf_folder, sp_model, tmp_path, capsys):
    """The trainer, tools/preprocess_data.py, the Hugging Face import and export: one line
    each (a sentencepiece model of random bytes was a traceback in preprocess_data.py, a giant
    tokenizer.json an IndexError), and a giant file is refused by its size, unread."""
    import time

    from megatron.sdp4bit.training.checkpoint.hf import tokenizer as hf_tokenizer
    from megatron.sdp4bit.training.guards import preflight
    from megatron.sdp4bit.training.tokenizers import registry
    from tests.helpers.scripts import load_tool

    preprocess, import_hf = load_tool("tools/preprocess_data.py"), load_tool(
        "tools/checkpoint/import_hf.py")
    (tmp_path / "in.jsonl").write_text('{"text": "hello world"}\n')
    for name, (kind, flags, folder) in _bad_tokenizers(
            tmp_path, gpt2_files, hf_folder, sp_model).items():
        args = argparse.Namespace(tokenizer_type=kind, **flags)
        paths = [p for p in flags.values() if os.path.isfile(p)] or [
            os.path.join(folder, "tokenizer.json")]
        giant = [p for p in paths if os.path.getsize(p) == GIANT]
        record = {"type": kind, "args": flags, "vocab_size": 300, "eod": 2, "bos": 1,
                  "pad": None, "sha256": {p: "0" * 64 if p in giant else registry.sha256(p)
                                          for p in registry.REGISTRY[kind].identifying_files(args)}}
        start = time.monotonic()
        with pytest.raises(preflight.InputError) as err:
            preflight.check_tokenizer(args, build_tokenizer)
        lines = {"trainer": str(err.value)}
        assert preprocess.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                str(tmp_path / "out"), "--tokenizer-type", kind,
                                *[x for k, v in flags.items()
                                  for x in (f"--{k.replace('_', '-')}", v)]]) == 1
        lines["preprocess"] = capsys.readouterr().err.removeprefix("preprocess_data.py: error: ")
        assert import_hf._source_tokenizer(str(folder), 300)[0] is None
        lines["import"] = import_hf._source_tokenizer(str(folder), 300)[1]
        tok, _, why = hf_tokenizer.choose({"tokenizer": record}, None, None)
        assert tok is None
        lines["export"] = why
        assert time.monotonic() - start < 60, name
        for path, line in lines.items():
            assert line and "\n" not in line.strip() and "Traceback" not in line, (name, path)
        if giant:
            size = (f"tokenizer file {giant[0]} is {GIANT} bytes, more than the 256 MiB a "
                    "tokenizer file is read up to: it is not a tokenizer's file (a wrong path?)")
            assert all(size in line for line in lines.values()), (name, lines)
        else:
            assert all(str(folder) in line for line in lines.values()), (name, lines)
