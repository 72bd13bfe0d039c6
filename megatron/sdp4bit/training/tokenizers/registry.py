"""The tokenizers ``--tokenizer-type`` names: one :class:`TokenizerSpec` per tokenizer.

Everything that depends on the tokenizer type reads this table: the ``--tokenizer-type``
choices and the required-flag checks of the command line (``cli/arguments.py``,
``cli/validate.py``), ``tools/preprocess_data.py``, :func:`build_tokenizer`, the record a
checkpoint's manifest keeps of the tokenizer (:func:`record`) and the Hugging Face export's
rebuilding of it (:func:`from_record`). Adding a tokenizer is one entry here plus its own
module beside this one. The names and meanings are Megatron-LM's.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megatron.sdp4bit import trusted_paths
from megatron.sdp4bit.training.tokenizers.base import Tokenizer, check_sizes, sha256
from megatron.sdp4bit.training.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.sdp4bit.training.tokenizers.huggingface import HuggingFaceTokenizer, tokenizer_files
from megatron.sdp4bit.training.tokenizers.null import NullTokenizer
from megatron.sdp4bit.training.tokenizers.sentence_piece import (
    GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer)


def _given(value: Any) -> bool:
    return bool(value)


@dataclass(frozen=True)
class Needs:
    """A flag a tokenizer cannot be built without. ``usage`` is how a refusal spells it
    (default: the flag); ``valid`` says whether a value will do (default: any non-empty);
    ``path``: the value names a file or folder."""

    flag: str
    usage: str = ""
    valid: Callable[[Any], bool] = _given
    path: bool = True

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


@dataclass(frozen=True)
class TokenizerSpec:
    """One ``--tokenizer-type``.

    ``name`` is Megatron-LM's spelling; ``build`` makes the tokenizer from the parsed flags;
    ``needs`` the flags it requires; ``special_ids`` says how its end-of-document (``eod``),
    beginning-of-sequence (``bos``) and padding (``pad``) ids are defined;
    ``mock_defaults`` are flag values it takes when ``--mock-data`` leaves them unset;
    ``files`` lists the files that identify it (default: the files its flags name);
    ``refused``: why this trainer does not offer it (None: it does)."""

    name: str
    build: Callable[[argparse.Namespace], Tokenizer]
    needs: tuple[Needs, ...]
    special_ids: str
    mock_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    files: Callable[[argparse.Namespace], list[str]] | None = None
    refused: str | None = None

    def missing(self, args: argparse.Namespace) -> str | None:
        """The refusal when the tokenizer is not offered or a needed flag is absent or
        invalid, else None."""
        if self.refused:
            return f"--tokenizer-type {self.name} is not supported by this trainer: {self.refused}"
        if all(n.valid(getattr(args, n.dest, None)) for n in self.needs):
            return None
        return (f"--tokenizer-type {self.name} needs "
                + " and ".join(n.usage or n.flag for n in self.needs))

    def identifying_files(self, args: argparse.Namespace) -> list[str]:
        """The absolute paths of the files that identify this tokenizer."""
        if self.files is not None:
            return [os.path.abspath(p) for p in self.files(args)]
        return [os.path.abspath(getattr(args, n.dest)) for n in self.needs if n.path]


def _null(args: argparse.Namespace) -> NullTokenizer:
    if args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    return NullTokenizer(args.vocab_size)


def _refused(why: str) -> Callable[[argparse.Namespace], Tokenizer]:
    def build(args: argparse.Namespace) -> Tokenizer:
        raise ValueError(f"--tokenizer-type {args.tokenizer_type} is not supported by this "
                         f"trainer: {why}")
    return build


_MODEL = (Needs("--tokenizer-model"),)
_SP_IDS = ("eod: the model's eos piece (</s>); bos and pad: the model's, none where it has "
           "none")
_TIKTOKEN = ("it needs the tiktoken package, which is not among this trainer's dependencies: "
             "use HuggingFaceTokenizer with the model's tokenizer folder")

_SPECS = (
    TokenizerSpec(
        "GPT2BPETokenizer", lambda a: GPT2BPETokenizer(a.vocab_file, a.merge_file),
        (Needs("--vocab-file"), Needs("--merge-file")),
        "eod: the vocabulary's <|endoftext|>; bos: the same token (as GPT-2's config); "
        "pad: none"),
    TokenizerSpec(
        "HuggingFaceTokenizer", lambda a: HuggingFaceTokenizer(a.tokenizer_model), _MODEL,
        "eod: the tokenizer's eos token; bos and pad: its bos and pad tokens (none where it "
        "has none); the bos or other tokens it adds to a text itself stay",
        files=lambda a: [os.path.join(a.tokenizer_model, n)
                         for n in tokenizer_files(a.tokenizer_model)]),
    TokenizerSpec(
        "GPTSentencePieceTokenizer", lambda a: GPTSentencePieceTokenizer(a.tokenizer_model),
        _MODEL, _SP_IDS),
    TokenizerSpec(
        "Llama2Tokenizer", lambda a: Llama2Tokenizer(a.tokenizer_model), _MODEL,
        _SP_IDS + "; every text starts with bos"),
    TokenizerSpec(
        "SentencePieceTokenizer", lambda a: SentencePieceTokenizer(a.tokenizer_model), _MODEL,
        "eod: <EOD>, appended after the model's pieces with <CLS>, <SEP>, <MASK> (unless the "
        "model has them); bos and pad: the model's, or <BOS> and <PAD> appended"),
    TokenizerSpec(
        "TikTokenizer", _refused(_TIKTOKEN), _MODEL, "eod and bos: </s> and <s> of its "
        "special tokens", refused=_TIKTOKEN),
    TokenizerSpec(
        "NullTokenizer", _null,
        (Needs("--vocab-size", "--vocab-size N (N >= 2)",
               lambda v: v is not None and v >= 2, path=False),),
        "eod: --vocab-size (one id past the text's ids); bos and pad: none",
        MappingProxyType({"vocab_size": 1024})),
)

REGISTRY: Mapping[str, TokenizerSpec] = MappingProxyType({s.name: s for s in _SPECS})

# --tokenizer-type left out: GPT-2 BPE (Megatron-LM's usual one), or with --mock-data and
# no --vocab-file the null tokenizer, which needs no files.
DEFAULT = "GPT2BPETokenizer"
MOCK_DEFAULT = "NullTokenizer"


def names() -> tuple[str, ...]:
    """The ``--tokenizer-type`` choices, in the registry's order."""
    return tuple(REGISTRY)


def needing(flag: str) -> list[str]:
    """The offered tokenizers that need ``flag``."""
    return [s.name for s in REGISTRY.values()
            if not s.refused and any(n.flag == flag for n in s.needs)]


def build_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer named by ``args.tokenizer_type`` (raises ``ValueError``); its files are
    no larger than a tokenizer's (``base.check_sizes``) before any library reads them."""
    spec = REGISTRY.get(args.tokenizer_type)
    if spec is None:
        choices = names()
        raise ValueError(f"--tokenizer-type {args.tokenizer_type!r}: use "
                         f"{', '.join(choices[:-1])} or {choices[-1]}")
    check_sizes(_identifying(spec, args))
    return spec.build(args)


def _identifying(spec: TokenizerSpec, args: argparse.Namespace) -> list[str]:
    """:meth:`TokenizerSpec.identifying_files`, empty when a flag it needs is absent (the
    tokenizer's constructor names it)."""
    try:
        return spec.identifying_files(args)
    except TypeError:
        return []


def check_files(args: argparse.Namespace) -> None:
    """The trust rule (``megatron/sdp4bit/trusted_paths.py``) for the tokenizer's files:
    every file or folder its path flags name, and every entry of such a folder (a Hugging
    Face tokenizer's); raises ``trusted_paths.UntrustedPathError`` (a ``ValueError``) naming
    the first that breaks it. The trainer and the tools check the flags they are given the
    same way (``guards/preflight.check_tokenizer_files``); this is the export's check of the
    files a manifest's record names."""
    spec = REGISTRY[args.tokenizer_type]
    for need in spec.needs:
        path = getattr(args, need.dest, None)
        if need.path and path and os.path.lexists(path):
            trusted_paths.check_with_entries(
                path, need.flag, "copy it to a folder of yours that only you can write",
                "copy the folder to one of yours that only you can write")


def record(args: argparse.Namespace, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a checkpoint's manifest keeps of the run's tokenizer: its type, the flags it was
    built from (paths made absolute), the SHA-256 of the files that identify it (every file
    a Hugging Face export ships), its vocabulary size and special ids."""
    spec = REGISTRY[args.tokenizer_type]
    flags = {n.dest: (os.path.abspath(getattr(args, n.dest)) if n.path
                      else getattr(args, n.dest)) for n in spec.needs}
    return {"type": spec.name, "args": flags,
            "sha256": {p: sha256(p) for p in spec.identifying_files(args)},
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "bos": tokenizer.bos,
            "pad": tokenizer.pad}


class RecordRefused(ValueError):
    """A manifest's tokenizer record that does not vouch for a file it would have read (no
    SHA-256 for it), or a file the trust rule refuses: one line naming it."""


def from_record(saved: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a manifest's :func:`record` describes, rebuilt from its files.

    Every file it is built from (:meth:`TokenizerSpec.identifying_files`: for a Hugging
    Face folder, every tokenizer file in it now) must keep the trust rule and have its
    SHA-256 in the record, else :class:`RecordRefused`; a recorded file that is gone, larger
    than a tokenizer's or changed since is ``ValueError``, in one line."""
    spec = REGISTRY.get(saved.get("type"))
    if spec is None:
        raise ValueError(f"the recorded tokenizer type {saved.get('type')!r} is unknown here")
    given, digests = saved.get("args"), saved.get("sha256")
    dests = {n.dest for n in spec.needs}
    if not (isinstance(given, dict) and set(given) == dests
            and all(isinstance(v, str) for n in spec.needs if n.path for v in [given[n.dest]])
            and isinstance(digests, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in digests.items())):
        raise RecordRefused(f"the checkpoint's {spec.name} record is not one this trainer "
                            "writes (its flags or SHA-256 table): refusing it")
    args = argparse.Namespace(tokenizer_type=spec.name, **given)
    try:
        check_files(args)
    except trusted_paths.UntrustedPathError as err:
        raise RecordRefused(str(err)) from None
    paths = spec.identifying_files(args)
    unrecorded = [p for p in paths if p not in digests]
    if unrecorded:
        raise RecordRefused(
            f"the checkpoint's {spec.name} record lists no SHA-256 for its file "
            f"{unrecorded[0]}, so nothing shows it is the file the model was trained with: "
            "refusing to read it (a file added to the folder since, or an edited record)")
    for path, digest in sorted(digests.items()):
        if not os.path.isfile(path):
            raise ValueError(f"its file {path} is gone")
    check_sizes(sorted(digests))
    for path, digest in sorted(digests.items()):
        if sha256(path) != digest:
            raise ValueError(f"its file {path} changed since the checkpoint was written")
    return build_tokenizer(args)
