"""SentencePiece models (the ``sentencepiece`` package, not reimplemented here), under
Megatron-LM's three names and meanings:

* ``GPTSentencePieceTokenizer``: the model's pieces as they are; end of document is its
  eos piece (``</s>``), bos and pad are the model's (none where it has none);
* ``Llama2Tokenizer``: the same, and every text starts with the bos piece (Llama 2's text
  completion);
* ``SentencePieceTokenizer``: the model's pieces plus ``<CLS>``, ``<SEP>``, ``<EOD>``,
  ``<MASK>`` (and a pad, bos or eos piece the model lacks), appended after its pieces
  unless the model has them; end of document is ``<EOD>``, and those pieces written in the
  text are their ids.
"""

from __future__ import annotations

import os

from megatron.sdp4bit.training.tokenizers.base import (
    HFTokenizerFiles, first_line, identity, optional_id, require_file)


def _load(model_file: str):
    """sentencepiece's processor of ``model_file``; a file it cannot read is ``ValueError``."""
    import sentencepiece

    require_file("--tokenizer-model", model_file)
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except Exception as err:  # noqa: BLE001 - sentencepiece raises RuntimeError, OSError, ...
        raise ValueError(f"--tokenizer-model {model_file}: sentencepiece cannot read it as a "
                         f"model ({first_line(err)})") from None


class GPTSentencePieceTokenizer:
    """A SentencePiece model as it is; end of document is its eos piece."""

    _adds_bos = False

    def __init__(self, model_file: str) -> None:
        self._file = model_file
        self._sp = _load(model_file)
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"--tokenizer-model {model_file} defines no eos piece to end "
                             "documents")
        self._eod = eos
        self.unique_identifiers = identity(self, tokenizer_model=os.path.abspath(model_file))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        return optional_id(self._sp.bos_id())

    @property
    def pad(self) -> int | None:
        return optional_id(self._sp.pad_id())

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))

    def _piece(self, i: int | None) -> str | None:
        return None if i is None else self._sp.id_to_piece(i)

    def hf_files(self) -> HFTokenizerFiles:
        # transformers reads a bare SentencePiece model as a LlamaTokenizer; whether it adds
        # the bos piece is the one difference between the two families.
        return HFTokenizerFiles({"tokenizer.model": self._file}, {
            "tokenizer_class": "LlamaTokenizer", "add_bos_token": self._adds_bos,
            "add_eos_token": False, "legacy": False, "bos_token": self._piece(self.bos),
            "eos_token": self._piece(self.eod), "pad_token": self._piece(self.pad),
            "unk_token": self._piece(optional_id(self._sp.unk_id()))})


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """A SentencePiece model whose every text starts with its bos piece (Llama 2)."""

    _adds_bos = True

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        if self.bos is None:
            raise ValueError(f"--tokenizer-model {model_file} defines no bos piece, which "
                             "Llama2Tokenizer puts before every text")

    def tokenize(self, text: str) -> list[int]:
        return [self._sp.bos_id()] + self._sp.encode(text)


class SentencePieceTokenizer:
    """Megatron-LM's ``SentencePieceTokenizer``: the model's pieces plus ``<CLS>``,
    ``<SEP>``, ``<EOD>``, ``<MASK>`` and the pad/bos/eos pieces it lacks; end of document
    ``<EOD>``."""

    def __init__(self, model_file: str) -> None:
        self._sp = _load(model_file)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}
        self._special: dict[str, int] = {}  # in Megatron-LM's order: the first match wins

        def add(piece: str) -> int:
            if piece not in self._vocab:
                self._vocab[piece] = len(self._vocab)
            self._special[piece] = self._vocab[piece]
            return self._vocab[piece]

        for piece in ("<CLS>", "<SEP>"):
            add(piece)
        self._eod = add("<EOD>")
        add("<MASK>")
        model_ids = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id())
        self._pad, self._bos, _ = (
            add(self._sp.id_to_piece(i) if 0 <= i < self._sp.get_piece_size() else fallback)
            for i, fallback in zip(model_ids, ("<PAD>", "<BOS>", "<EOS>")))
        self._by_id = {i: piece for piece, i in self._special.items()}
        self.unique_identifiers = identity(self, tokenizer_model=os.path.abspath(model_file))

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        """The special pieces written in the text are their ids; the rest is encoded."""
        ids: list[int] = []
        start = 0
        while True:
            found = [(text.find(piece, start), n, piece)
                     for n, piece in enumerate(self._special) if text.find(piece, start) >= 0]
            if not found:
                break
            at, _, piece = min(found)
            ids += self._sp.encode(text[start:at]) + [self._special[piece]]
            start = at + len(piece)
        return ids + self._sp.encode(text[start:])

    def detokenize(self, ids: list[int]) -> str:
        text, last = "", 0
        ids = list(ids)
        for n, i in enumerate(ids):
            if i in self._by_id:
                text += self._sp.decode(ids[last:n]) + " " + self._by_id[i] + " "
                last = n + 1
        return text + self._sp.decode(ids[last:])

    def hf_files(self) -> str:
        return ("the ids SentencePieceTokenizer appends after the model's pieces (<CLS>, "
                "<SEP>, <EOD>, <MASK>) have no Hugging Face tokenizer file")
