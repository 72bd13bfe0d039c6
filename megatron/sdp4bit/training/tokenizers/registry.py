"""The tokenizers ``--tokenizer-type`` names: one :class:`TokenizerSpec` per tokenizer.

Everything that depends on the tokenizer type reads this table: the ``--tokenizer-type``
choices and the required-flag checks of the command line (``cli/arguments.py``,
``cli/validate.py``), ``tools/preprocess_data.py``, and :func:`build_tokenizer`. Adding a
tokenizer is one entry here plus its own module beside this one.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megatron.sdp4bit.training.tokenizers.base import Tokenizer
from megatron.sdp4bit.training.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.sdp4bit.training.tokenizers.null import NullTokenizer
from megatron.sdp4bit.training.tokenizers.sentence_piece import SentencePieceTokenizer


def _given(value: Any) -> bool:
    return bool(value)


@dataclass(frozen=True)
class Needs:
    """A flag a tokenizer cannot be built without. ``usage`` is how a refusal spells it
    (default: the flag); ``valid`` says whether a value will do (default: any non-empty)."""

    flag: str
    usage: str = ""
    valid: Callable[[Any], bool] = _given

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


@dataclass(frozen=True)
class TokenizerSpec:
    """One ``--tokenizer-type``.

    ``name`` is Megatron-LM's spelling; ``build`` makes the tokenizer from the parsed flags;
    ``needs`` the flags it requires; ``special_ids`` says how its end-of-document (``eod``),
    beginning-of-sequence (``bos``) and padding (``pad``) ids are defined;
    ``mock_defaults`` are flag values it takes when ``--mock-data`` leaves them unset."""

    name: str
    build: Callable[[argparse.Namespace], Tokenizer]
    needs: tuple[Needs, ...]
    special_ids: str
    mock_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def missing(self, args: argparse.Namespace) -> str | None:
        """The refusal when a needed flag is absent or invalid, else None."""
        if all(n.valid(getattr(args, n.dest, None)) for n in self.needs):
            return None
        return (f"--tokenizer-type {self.name} needs "
                + " and ".join(n.usage or n.flag for n in self.needs))


def _null(args: argparse.Namespace) -> NullTokenizer:
    if args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    return NullTokenizer(args.vocab_size)


_SPECS = (
    TokenizerSpec(
        "GPT2BPETokenizer", lambda a: GPT2BPETokenizer(a.vocab_file, a.merge_file),
        (Needs("--vocab-file"), Needs("--merge-file")),
        "eod: the vocabulary's <|endoftext|>; bos: the same token (as GPT-2's config); "
        "pad: none"),
    TokenizerSpec(
        "SentencePieceTokenizer", lambda a: SentencePieceTokenizer(a.tokenizer_model),
        (Needs("--tokenizer-model"),),
        "eod: the model's eos piece (</s>); bos and pad: the model's, when it defines them"),
    TokenizerSpec(
        "NullTokenizer", _null,
        (Needs("--vocab-size", "--vocab-size N (N >= 2)",
               lambda v: v is not None and v >= 2),),
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


def build_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer named by ``args.tokenizer_type`` (raises ``ValueError``)."""
    spec = REGISTRY.get(args.tokenizer_type)
    if spec is None:
        choices = names()
        raise ValueError(f"--tokenizer-type {args.tokenizer_type!r}: use "
                         f"{', '.join(choices[:-1])} or {choices[-1]}")
    return spec.build(args)
