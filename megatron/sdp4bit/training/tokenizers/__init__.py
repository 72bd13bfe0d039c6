"""Tokenizers of Megatron-LM's ``--tokenizer-type``: GPT-2 BPE, SentencePiece, Null.

Each exposes ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]`` and
``detokenize(ids) -> str``, which is all megatron-core's ``GPTDataset`` and the
preprocessing tool need. The GPT-2 tokenizer is Hugging Face ``tokenizers``' byte-level
BPE over GPT-2's ``vocab.json``/``merges.txt``; SentencePiece is the ``sentencepiece``
package. Neither is reimplemented here.
"""

from __future__ import annotations

import argparse
import os

GPT2_EOD = "<|endoftext|>"


def _require_file(flag: str, path: str | None) -> str:
    if not path:
        raise ValueError(f"{flag} is required for this tokenizer")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    return path


def _identity(tok: object, **fields: object) -> dict[str, object]:
    # megatron-core hashes ``tokenizer.unique_identifiers`` into the names of its cached
    # dataset index files: a different tokenizer must give a different cache.
    return {"class": type(tok).__name__, **fields}


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``; end of document ``<|endoftext|>``."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        _require_file("--vocab-file", vocab_file)
        _require_file("--merge-file", merge_file)
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:  # tokenizers raises its own Exception type on bad files
            raise ValueError(f"cannot read GPT-2 BPE files {vocab_file}, {merge_file}: {err}") from err
        tok = Tokenizer(model)
        # GPT-2 splits on its own regex and never adds a prefix space.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        eod = tok.token_to_id(GPT2_EOD)
        if eod is None:
            raise ValueError(f"--vocab-file {vocab_file} has no {GPT2_EOD} token")
        self._eod = eod
        self.unique_identifiers = _identity(self, vocab_file=os.path.abspath(vocab_file),
                                            merge_file=os.path.abspath(merge_file))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class SentencePieceTokenizer:
    """A SentencePiece model; end of document is its ``</s>`` (eos) piece."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        _require_file("--tokenizer-model", model_file)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"--tokenizer-model {model_file} defines no eos piece to end documents")
        self._eod = eos
        self.unique_identifiers = _identity(self, tokenizer_model=os.path.abspath(model_file))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


class NullTokenizer:
    """Text is space-separated ids below ``vocab_size``; ``eod = vocab_size`` (Megatron-LM's rule)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"--vocab-size={vocab_size} must be >= 1")
        self._n = vocab_size
        self.unique_identifiers = _identity(self, vocab_size=vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1  # the ids plus the end-of-document id

    @property
    def eod(self) -> int:
        return self._n

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as err:
            raise ValueError(f"NullTokenizer takes space-separated integers: {err}") from err
        bad = [i for i in ids if not 0 <= i < self._n]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} outside [0, {self._n})")
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


Tokenizer = GPT2BPETokenizer | SentencePieceTokenizer | NullTokenizer


def build_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer named by ``args.tokenizer_type`` (raises ``ValueError``)."""
    kind = args.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if kind == "SentencePieceTokenizer":
        return SentencePieceTokenizer(args.tokenizer_model)
    if kind == "NullTokenizer":
        if args.vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(args.vocab_size)
    raise ValueError(f"--tokenizer-type {kind!r}: use GPT2BPETokenizer, SentencePieceTokenizer "
                     "or NullTokenizer")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron-LM's padding: round up to a multiple of ``divisible_by x TP`` so that every
    tensor-parallel shard of the embedding has the same, well-aligned size."""
    multiple = divisible_by * tensor_parallel_size
    if multiple < 1:
        raise ValueError(f"--make-vocab-size-divisible-by={divisible_by} must be >= 1")
    return -(-vocab_size // multiple) * multiple
