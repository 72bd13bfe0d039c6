"""The tokenizer a Hugging Face export ships, and the special ids of its ``config.json``.

The checkpoint's manifest records the run's tokenizer (``tokenizers.registry.record``): its
type, the files it was built from with their SHA-256, and its end-of-document, bos and pad
ids. The export writes those ids into ``config.json`` (``eos_token_id`` is the
end-of-document id) and ships the tokenizer's files when they are still what they were and
transformers, reading them back, gives the trainer's ids on a few texts
(``tokenizers.base.PROBES``). Otherwise it ships no tokenizer and says why in one line:
never a tokenizer other than the one the model was trained with. A file it would read that
the trust rule refuses, or that the record gives no SHA-256 for (``registry.from_record``),
stops the export; each file shipped is hashed while it is copied and must have the
record's SHA-256.

A manifest of an older trainer records no tokenizer: ``--vocab-file``/``--merge-file``
name the GPT-2 BPE files such a run used; without them no tokenizer and no ids are written.
With a recorded GPT-2 tokenizer they say where its files are now (the same files, by
SHA-256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from typing import Any

from megatron.sdp4bit import trusted_paths

from megatron.sdp4bit.training.checkpoint.hf.common import ExportError
from megatron.sdp4bit.training.tokenizers import registry
from megatron.sdp4bit.training.tokenizers.base import PROBES, HFTokenizerFiles, Tokenizer, sha256


def _ids(tok: Any) -> dict[str, int | None]:
    get = tok.get if isinstance(tok, dict) else lambda k: getattr(tok, k)
    return {"bos_token_id": get("bos"), "eos_token_id": get("eod"), "pad_token_id": get("pad")}


NO_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def choose(settings: dict, vocab_file: str | None, merge_file: str | None
           ) -> tuple[Tokenizer | None, dict[str, int | None], str | None]:
    """(the tokenizer to ship or None, the special ids for ``config.json``, why none is
    shipped or None)."""
    saved = settings.get("tokenizer")
    if vocab_file or merge_file:
        if not (vocab_file and merge_file):
            raise ExportError("--vocab-file and --merge-file go together (the GPT-2 BPE files "
                              "of the run)")
        if saved is not None:
            saved = _moved(saved, vocab_file, merge_file)
        try:
            tok = registry.build_tokenizer(argparse.Namespace(
                tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file,
                merge_file=merge_file))
        except ValueError as err:
            raise ExportError(str(err)) from None
        return tok, _ids(saved or tok), None
    if saved is None:
        return None, dict(NO_IDS), (
            "the manifest (an older trainer's) does not record the tokenizer: no tokenizer "
            "and no bos/eos ids written; pass --vocab-file and --merge-file if the run used "
            "GPT-2 BPE files")
    ids = _ids(saved)
    try:
        tok = registry.from_record(saved)
    except registry.RecordRefused as err:
        raise ExportError(str(err)) from None
    except ValueError as err:
        return None, ids, f"no tokenizer written: the run's {saved['type']}: {err}"
    except Exception as err:  # noqa: BLE001 - tokenizers/sentencepiece raise their own types
        return None, ids, (f"no tokenizer written: the run's {saved['type']} files do not "
                           f"load ({type(err).__name__}: {str(err).splitlines()[0][:160]})")
    return tok, ids, None


def _moved(saved: dict, vocab_file: str, merge_file: str) -> dict:
    """The manifest's GPT-2 record with its files where ``--vocab-file``/``--merge-file``
    say, when they are the same files; else the refusal."""
    if saved["type"] != "GPT2BPETokenizer":
        raise ExportError(f"the checkpoint's run used {saved['type']}, not GPT-2 BPE files: "
                          "drop --vocab-file and --merge-file (its tokenizer is recorded)")
    if sorted(map(sha256, (vocab_file, merge_file))) != sorted(saved["sha256"].values()):
        raise ExportError("--vocab-file/--merge-file are not the files the checkpoint's run "
                          "used (their SHA-256 differ from its manifest's): drop them to ship "
                          "the recorded ones")
    return saved


def digests(settings: dict, vocab_file: str | None, merge_file: str | None) -> dict[str, str]:
    """The SHA-256 every file the export ships must have: the manifest's record's; for
    ``--vocab-file``/``--merge-file``, theirs when :func:`choose` checked them (the record's
    own, where there is one)."""
    given = [p for p in (vocab_file, merge_file) if p]
    if given:
        return {os.path.abspath(p): sha256(p) for p in given}
    return dict((settings.get("tokenizer") or {}).get("sha256") or {})


def write(folder: str, tok: Tokenizer, max_length: int, digests: dict[str, str]) -> str | None:
    """Ship ``tok``'s files into ``folder``, each only when its bytes have the SHA-256
    ``digests`` gives its path; returns why nothing was shipped, or None."""
    files = tok.hf_files()
    if isinstance(files, str):
        return f"no tokenizer written: {files}"
    written = _copy(folder, files, max_length, digests)
    problem = _differs(folder, tok)
    if problem is not None:
        for name in written:
            os.remove(os.path.join(folder, name))
        return f"no tokenizer written: {problem}"
    return None


def _copy(folder: str, files: HFTokenizerFiles, max_length: int,
          digests: dict[str, str]) -> list[str]:
    """Copy the tokenizer's files, hashing the bytes copied: a file without a recorded
    SHA-256, or whose bytes are not the recorded ones (changed since it was checked), or
    that the trust rule refuses, is refused (``ExportError``) and nothing of it stays."""
    for name, source in files.copies.items():
        expected = digests.get(os.path.abspath(source))
        if expected is None:
            raise ExportError(f"tokenizer file {source} has no SHA-256 in the checkpoint's "
                              "manifest: refusing to ship a file nothing checked")
        try:
            trusted_paths.check(source, "tokenizer file", "copy it to a folder of yours "
                                "that only you can write")
        except trusted_paths.UntrustedPathError as err:
            raise ExportError(str(err)) from None
        target = os.path.join(folder, name)
        digest = hashlib.sha256()
        with open(source, "rb") as src, open(target, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                dst.write(block)
        if digest.hexdigest() != expected:
            os.remove(target)
            raise ExportError(f"tokenizer file {source} changed while it was exported (its "
                              "SHA-256 is not the checkpoint's): nothing shipped; export again")
    written = list(files.copies)
    if files.config is not None:
        config = {"model_max_length": max_length, **files.config}
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)
        written.append("tokenizer_config.json")
    return written


def _differs(folder: str, tok: Tokenizer) -> str | None:
    """Why transformers' tokenizer read from ``folder`` is not ``tok`` (None: it is)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return "transformers is not installed, so the files could not be checked"
    try:
        theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                               trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - transformers raises many types
        return (f"transformers cannot read the tokenizer files ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:160]})")
    if len(theirs) != tok.vocab_size:
        return (f"transformers reads {len(theirs)} tokens from the files, the trainer's "
                f"tokenizer has {tok.vocab_size}")
    for text in PROBES:
        ours, hf = tok.tokenize(text), list(theirs(text).input_ids)
        if ours != hf:
            at = next((i for i, (a, b) in enumerate(zip(ours, hf)) if a != b),
                      min(len(ours), len(hf)))
            return (f"transformers' tokenizer from the files gives other ids than the "
                    f"trainer's for {text!r} (from token {at}: {hf[at:at + 4]} instead of "
                    f"{ours[at:at + 4]})")
    return None
