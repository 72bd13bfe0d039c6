"""Megatron-LM's ``NullTokenizer``: the text is already ids."""

from __future__ import annotations

from megatron.sdp4bit.training.tokenizers.base import identity


class NullTokenizer:
    """Text is space-separated ids below ``vocab_size``; ``eod = vocab_size`` (Megatron-LM's
    rule); no bos or pad."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"--vocab-size={vocab_size} must be >= 1")
        self._n = vocab_size
        self.unique_identifiers = identity(self, vocab_size=vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1  # the ids plus the end-of-document id

    @property
    def eod(self) -> int:
        return self._n

    @property
    def bos(self) -> None:
        return None

    @property
    def pad(self) -> None:
        return None

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

    def hf_files(self) -> str:
        return "a NullTokenizer has no files: its text is the ids"
