"""GPT-2's byte-level BPE (Megatron-LM's ``GPT2BPETokenizer``) over ``vocab.json`` and
``merges.txt``, read by Hugging Face ``tokenizers`` (not reimplemented here)."""

from __future__ import annotations

import os

from megatron.sdp4bit.training.tokenizers.base import (HFTokenizerFiles, first_line, identity,
                                                         require_file)

GPT2_EOD = "<|endoftext|>"


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``; end of document
    ``<|endoftext|>``, which GPT-2's Hugging Face config also names its bos token."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        require_file("--vocab-file", vocab_file)
        require_file("--merge-file", merge_file)
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:  # tokenizers raises its own Exception type on bad files
            raise ValueError(f"cannot read GPT-2 BPE files {vocab_file}, {merge_file}: "
                             f"{first_line(err)}") from None
        tok = Tokenizer(model)
        # GPT-2 splits on its own regex and never adds a prefix space.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        eod = tok.token_to_id(GPT2_EOD)
        if eod is None:
            raise ValueError(f"--vocab-file {vocab_file} has no {GPT2_EOD} token")
        self._eod = eod
        self._files = (vocab_file, merge_file)
        self.unique_identifiers = identity(self, vocab_file=os.path.abspath(vocab_file),
                                           merge_file=os.path.abspath(merge_file))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return self._eod

    @property
    def pad(self) -> None:
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def hf_files(self) -> HFTokenizerFiles:
        return HFTokenizerFiles(
            {"vocab.json": self._files[0], "merges.txt": self._files[1]},
            {"tokenizer_class": "GPT2Tokenizer", "bos_token": GPT2_EOD, "eos_token": GPT2_EOD,
             "unk_token": GPT2_EOD})
