"""SentencePiece models read by the ``sentencepiece`` package (not reimplemented here)."""

from __future__ import annotations

import os

from megatron.sdp4bit.training.tokenizers.base import identity, require_file


class SentencePieceTokenizer:
    """A SentencePiece model; end of document is its ``</s>`` (eos) piece."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        require_file("--tokenizer-model", model_file)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"--tokenizer-model {model_file} defines no eos piece to end documents")
        self._eod = eos
        self.unique_identifiers = identity(self, tokenizer_model=os.path.abspath(model_file))

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
