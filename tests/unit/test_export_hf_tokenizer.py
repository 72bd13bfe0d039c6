"""tools/checkpoint/export_hf.py ships the tokenizer the checkpoint's run was trained with,
read back by transformers with the trainer's ids, and writes its special ids into
config.json; where it cannot, it ships none and says why in one line."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from megatron.sdp4bit.training.tokenizers import build_tokenizer, registry
from tests.helpers.corpora import TEXT, write_gpt2_vocab, write_hf_tokenizer, write_sentencepiece
from tests.helpers.hf_checkpoint import write_gpt2_checkpoint
from tests.helpers.scripts import load_tool

export_hf = load_tool("tools/checkpoint/export_hf.py")

# A GPT-2 shape whose 384 padded rows hold the tokenizers' 300 tokens.
MODEL = {"num_layers": 1, "hidden_size": 8, "ffn_hidden_size": 32, "num_attention_heads": 2,
         "kv_channels": None, "group_query_attention": False, "num_query_groups": 1,
         "max_position_embeddings": 16, "position_embedding_type": "learned_absolute",
         "rotary_base": 10000, "rotary_percent": 1.0,
         "untie_embeddings_and_output_weights": False, "swiglu": False, "openai_gelu": False,
         "normalization": "LayerNorm", "norm_epsilon": 1e-5, "add_bias_linear": True,
         "params_dtype": "bf16", "padded_vocab_size": 384}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, argparse.Namespace]:
    """The flags of one tokenizer of each kind, built from files made here."""
    d = tmp_path_factory.mktemp("tokenizers")
    vocab, merges = write_gpt2_vocab(d / "gpt2")
    llama_like = write_sentencepiece(d / "llama.model")
    plain = write_sentencepiece(d / "plain.model", vocab_size=60, llama_like=False)
    flags = {
        "gpt2": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
        "hf": dict(tokenizer_type="HuggingFaceTokenizer",
                   tokenizer_model=write_hf_tokenizer(d / "hf")),
        "llama2": dict(tokenizer_type="Llama2Tokenizer", tokenizer_model=llama_like),
        "gpt_sp": dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=llama_like),
        "plain_sp": dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=plain),
        "megatron_sp": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=llama_like),
        "null": dict(tokenizer_type="NullTokenizer", vocab_size=299)}
    return {k: argparse.Namespace(**v) for k, v in flags.items()}


def _export(root, tmp_path, args: argparse.Namespace | None, capsys, **extra):
    """Export a checkpoint whose manifest records ``args``' tokenizer (None: none); returns
    (the output folder, its config.json, the notes printed)."""
    tok = build_tokenizer(args) if args is not None else None
    settings = {"tokenizer": registry.record(args, tok)} if tok is not None else {}
    if tok is not None:
        settings["vocab_size"] = tok.vocab_size
    write_gpt2_checkpoint(root, MODEL, settings=settings)
    out = tmp_path / "out"
    capsys.readouterr()
    assert export_hf.export(str(root), str(out), overwrite=True, **extra) == "GPT2LMHeadModel"
    config = json.loads((out / "config.json").read_text())
    return out, config, capsys.readouterr().err.splitlines()


def test_the_runs_tokenizer_is_shipped_with_its_ids(tokenizers, tmp_path, capsys):
    from transformers import AutoTokenizer

    shipped = {"gpt2": ["merges.txt", "tokenizer_config.json", "vocab.json"],
               "hf": ["tokenizer.json", "tokenizer_config.json"],
               "llama2": ["tokenizer.model", "tokenizer_config.json"],
               "gpt_sp": ["tokenizer.model", "tokenizer_config.json"]}
    for kind, names in shipped.items():
        tok = build_tokenizer(tokenizers[kind])
        out, config, notes = _export(tmp_path / kind, tmp_path, tokenizers[kind], capsys)
        assert notes == [], (kind, notes)
        assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors", *names])
        assert (config["vocab_size"], config["eos_token_id"], config["bos_token_id"],
                config["pad_token_id"]) == (tok.vocab_size, tok.eod, tok.bos, tok.pad), kind
        theirs = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        for text in TEXT[:3]:
            assert theirs(text).input_ids == tok.tokenize(text), (kind, text)
    assert (config["eos_token_id"], config["bos_token_id"]) == (2, 1)  # the model's </s>, <s>


def test_where_no_tokenizer_can_be_shipped_none_is_and_one_line_says_why(
        tokenizers, tmp_path, capsys):
    cases = {
        "null": "note: no tokenizer written: a NullTokenizer has no files: its text is the ids",
        "megatron_sp": "note: no tokenizer written: the ids SentencePieceTokenizer appends "
                       "after the model's pieces (<CLS>, <SEP>, <EOD>, <MASK>) have no Hugging "
                       "Face tokenizer file",
        # a model with sentencepiece's defaults (NFKC normalization, no byte fallback):
        # transformers' conversion of it splits words differently
        "plain_sp": "note: no tokenizer written: transformers' tokenizer from the files gives "
                    "other ids than the trainer's for 'the quick brown fox jumps over the lazy "
                    "dog' (from token "}
    for kind, note in cases.items():
        tok = build_tokenizer(tokenizers[kind])
        out, config, notes = _export(tmp_path / kind, tmp_path, tokenizers[kind], capsys)
        assert len(notes) == 1 and notes[0].startswith(note), (kind, notes)
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"], kind
        # the ids are the run's all the same
        assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (
            tok.eod, tok.bos, tok.pad), kind
    assert config["eos_token_id"] == 2
    gpt2 = tokenizers["gpt2"]
    with pytest.raises(export_hf.ExportError) as err:
        export_hf.export(str(tmp_path / "null"), str(tmp_path / "out2"),
                         vocab_file=gpt2.vocab_file, merge_file=gpt2.merge_file)
    assert str(err.value) == ("the checkpoint's run used NullTokenizer, not GPT-2 BPE files: "
                              "drop --vocab-file and --merge-file (its tokenizer is recorded)")


def test_changed_files_and_an_older_manifest_ship_no_tokenizer(tokenizers, tmp_path, capsys):
    import shutil

    args = tokenizers["gpt2"]
    moved = argparse.Namespace(**{**vars(args), "vocab_file": str(tmp_path / "vocab.json")})
    shutil.copyfile(args.vocab_file, moved.vocab_file)
    root = tmp_path / "changed"
    tok = build_tokenizer(moved)
    write_gpt2_checkpoint(root, MODEL, settings={"tokenizer": registry.record(moved, tok)})
    with open(moved.vocab_file, "a", encoding="utf-8") as f:
        f.write("\n")
    capsys.readouterr()
    export_hf.export(str(root), str(tmp_path / "out"))
    assert capsys.readouterr().err == (
        f"note: no tokenizer written: the run's GPT2BPETokenizer: its file {moved.vocab_file} "
        "changed since the checkpoint was written\n")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    # --vocab-file/--merge-file: where the recorded files are now, not other files
    with pytest.raises(export_hf.ExportError) as err:
        export_hf.export(str(root), str(tmp_path / "out2"), vocab_file=moved.vocab_file,
                         merge_file=args.merge_file)
    assert str(err.value) == ("--vocab-file/--merge-file are not the files the checkpoint's "
                              "run used (their SHA-256 differ from its manifest's): drop them "
                              "to ship the recorded ones")
    export_hf.export(str(root), str(tmp_path / "out3"), vocab_file=args.vocab_file,
                     merge_file=args.merge_file)
    assert capsys.readouterr().err == ""
    assert "vocab.json" in os.listdir(tmp_path / "out3")
    # An older trainer's manifest: no tokenizer, no ids, unless the GPT-2 files are named.
    out, config, notes = _export(tmp_path / "older", tmp_path, None, capsys)
    assert notes == ["note: the manifest (an older trainer's) does not record the tokenizer: "
                     "no tokenizer and no bos/eos ids written; pass --vocab-file and "
                     "--merge-file if the run used GPT-2 BPE files"]
    assert (config["eos_token_id"], config["bos_token_id"]) == (None, None)
    out, config, notes = _export(tmp_path / "older2", tmp_path, None, capsys,
                                 vocab_file=args.vocab_file, merge_file=args.merge_file)
    eod = build_tokenizer(args).eod
    assert notes == [] and (config["eos_token_id"], config["bos_token_id"]) == (eod, eod)
    assert "vocab.json" in os.listdir(out)


def test_the_export_ships_only_trusted_files_whose_sha256_the_record_gives(
        tokenizers, tmp_path, capsys):
    """A world-writable tokenizer folder was shipped from; a settings.tokenizer rewritten to
    another folder with an empty sha256 had that folder's files shipped."""
    import shutil

    from megatron.sdp4bit.training.checkpoint.files import CheckpointError
    from tests.helpers import crafted

    hf = tmp_path / "tokenizer"
    shutil.copytree(tokenizers["hf"].tokenizer_model, hf)
    args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf))
    root = tmp_path / "ckpt"
    _export(root, tmp_path, args, capsys)  # ships it while nothing is wrong
    folder = root / "iter_0000002"

    def refused(out: str) -> str:
        with pytest.raises(export_hf.ExportError) as err:
            export_hf.export(str(root), str(tmp_path / out))
        assert not (tmp_path / out).exists()
        return str(err.value)

    hf.chmod(0o777)
    assert refused("writable") == (
        f"--tokenizer-model {hf} is writable by group or others (mode 0777): refused, another "
        "user could change what the run reads; copy it to a folder of yours that only you can "
        "write")
    hf.chmod(0o755)

    other = tmp_path / "other"
    shutil.copytree(hf, other)
    (other / "tokenizer_config.json").write_text("{}")
    crafted.edit_settings(folder, lambda s: s["tokenizer"].update(
        args={"tokenizer_model": str(other)}, sha256={}))
    assert refused("elsewhere") == (
        f"the checkpoint's HuggingFaceTokenizer record lists no SHA-256 for its file "
        f"{other}/tokenizer.json, so nothing shows it is the file the model was trained with: "
        "refusing to read it (a file added to the folder since, or an edited record)")
    crafted.edit_settings(folder, lambda s: s["tokenizer"].update(sha256={"x": "0" * 64}),
                          seal=False)  # a hand edit: the manifest's own SHA-256 refuses it
    with pytest.raises(CheckpointError, match="does not match its own SHA-256"):
        export_hf.export(str(root), str(tmp_path / "edited"))

    # the run's folder, with a file added after the checkpoint was written
    root = tmp_path / "ckpt2"
    _export(root, tmp_path, args, capsys)
    (hf / "special_tokens_map.json").write_text("{}")
    assert refused("added") == (
        f"the checkpoint's HuggingFaceTokenizer record lists no SHA-256 for its file "
        f"{hf}/special_tokens_map.json, so nothing shows it is the file the model was trained "
        "with: refusing to read it (a file added to the folder since, or an edited record)")
