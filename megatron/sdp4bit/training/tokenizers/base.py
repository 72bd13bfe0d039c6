"""What every tokenizer family shares: the interface megatron-core's ``GPTDataset`` and the
preprocessing tool use, the file check of its flags, and its cache identity."""

from __future__ import annotations

import os
from typing import Protocol


class Tokenizer(Protocol):
    """``vocab_size``, the end-of-document id ``eod``, ``tokenize`` and ``detokenize`` (all
    megatron-core's ``GPTDataset`` and ``tools/preprocess_data.py`` need), and the
    ``unique_identifiers`` megatron-core hashes into its cached index file names."""

    unique_identifiers: dict[str, object]

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...


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


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron-LM's padding: round up to a multiple of ``divisible_by x TP`` so that every
    tensor-parallel shard of the embedding has the same, well-aligned size."""
    multiple = divisible_by * tensor_parallel_size
    if multiple < 1:
        raise ValueError(f"--make-vocab-size-divisible-by={divisible_by} must be >= 1")
    return -(-vocab_size // multiple) * multiple
