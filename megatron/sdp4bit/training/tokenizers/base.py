"""What every tokenizer family shares: the interface megatron-core's ``GPTDataset`` and the
preprocessing tool use, the file check of its flags, its cache identity, the files a
Hugging Face export ships, and the vocabulary padding."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class HFTokenizerFiles:
    """What a Hugging Face export writes for a tokenizer: ``copies`` (file name in the
    export -> the file it is copied from) and ``config``, the ``tokenizer_config.json`` to
    write (None: one of the copies is it)."""

    copies: dict[str, str]
    config: dict | None = None


# An export loads the tokenizer it wrote with transformers and compares its ids with the
# trainer's on these texts: ordinary prose, runs of spaces, new lines, tabs, digits and
# accents. (None starts with a space: transformers' SentencePiece conversion adds no word
# boundary before a leading space where sentencepiece does.)
PROBES = ("Hello world.", "the quick brown fox jumps over the lazy dog",
          "two  spaces,\nnew lines\tand tabs", "digits 12345 and accents \u00e9\u00fc")


class Tokenizer(Protocol):
    """``vocab_size``, the end-of-document id ``eod``, ``tokenize`` and ``detokenize`` (all
    megatron-core's ``GPTDataset`` and ``tools/preprocess_data.py`` need), the
    beginning-of-sequence and padding ids (None: the tokenizer has none), the
    ``unique_identifiers`` megatron-core hashes into its cached index file names, and
    :meth:`hf_files`, what a Hugging Face export ships (or why it ships nothing)."""

    unique_identifiers: dict[str, object]

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    @property
    def bos(self) -> int | None: ...

    @property
    def pad(self) -> int | None: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def hf_files(self) -> HFTokenizerFiles | str: ...


# The largest tokenizer file read. The largest released tokenizers' files are tens of MB
# (a 256k-token tokenizer.json is ~35 MB); a file past this is not one, and reading it (a
# sparse file of many GB, a wrong path) would take the machine's memory before any library
# could say so.
MAX_FILE_BYTES = 256 << 20


def check_sizes(paths: list[str]) -> None:
    """Every existing file of ``paths`` is at most :data:`MAX_FILE_BYTES`; else
    ``ValueError`` naming it (checked with ``stat``, before anything reads it)."""
    for path in paths:
        try:
            size = os.stat(path).st_size
        except OSError:
            continue  # missing: whoever opens it names it
        if size > MAX_FILE_BYTES:
            raise ValueError(f"tokenizer file {path} is {size} bytes, more than the "
                             f"{MAX_FILE_BYTES >> 20} MiB a tokenizer file is read up to: it "
                             "is not a tokenizer's file (a wrong path?)")


def first_line(err: BaseException) -> str:
    """``Type: first line`` of an exception a tokenizer library raised (some have no text;
    a bare ``Exception``, ``tokenizers``' type, is its text alone)."""
    lines = str(err).splitlines()
    if not lines:
        return type(err).__name__
    return lines[0][:200] if type(err) is Exception else f"{type(err).__name__}: {lines[0][:200]}"


def require_file(flag: str, path: str | None) -> str:
    """``path`` when it names a file; else ``ValueError`` naming ``flag``."""
    if not path:
        raise ValueError(f"{flag} is required for this tokenizer")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    return path


def identity(tok: object, **fields: object) -> dict[str, object]:
    """The tokenizer's ``unique_identifiers``: its class and what names its files."""
    # megatron-core hashes ``tokenizer.unique_identifiers`` into the names of its cached
    # dataset index files: a different tokenizer must give a different cache.
    return {"class": type(tok).__name__, **fields}


def sha256(path: str) -> str:
    """The file's SHA-256, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def optional_id(value: int | None) -> int | None:
    """A special id, None where the tokenizer has none (sentencepiece says -1)."""
    return None if value is None or value < 0 else int(value)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron-LM's padding: round up to a multiple of ``divisible_by x TP`` so that every
    tensor-parallel shard of the embedding has the same, well-aligned size."""
    multiple = divisible_by * tensor_parallel_size
    if multiple < 1:
        raise ValueError(f"--make-vocab-size-divisible-by={divisible_by} must be >= 1")
    return -(-vocab_size // multiple) * multiple
