"""Megatron-LM's ``HuggingFaceTokenizer``: a tokenizer folder (``save_pretrained``'s output)
read by ``transformers.AutoTokenizer``, from the local folder only: nothing is downloaded
and no code of the folder runs (``trust_remote_code=False``)."""

from __future__ import annotations

import os

from megatron.sdp4bit.training.tokenizers.base import HFTokenizerFiles, first_line, identity

# The files transformers reads for a tokenizer: what identifies one in a folder that may also
# hold a model's weights, and what an export copies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")


def tokenizer_files(folder: str) -> list[str]:
    """The tokenizer files of ``folder`` (names), in :data:`TOKENIZER_FILES`' order."""
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))]


class HuggingFaceTokenizer:
    """``AutoTokenizer`` of a local folder. As in Megatron-LM: the vocabulary is
    ``len(tokenizer)`` (added tokens included), ``tokenize`` is the tokenizer's ``input_ids``
    (with the special tokens it adds itself, e.g. a bos), end of document is its eos."""

    def __init__(self, folder: str | None) -> None:
        if not folder:
            raise ValueError("--tokenizer-model is required for this tokenizer")
        if not os.path.isdir(folder):
            raise ValueError(f"--tokenizer-model {folder}: not a folder (HuggingFaceTokenizer "
                             "reads a local tokenizer folder, save_pretrained's output; "
                             "nothing is downloaded)")
        if not tokenizer_files(folder):
            raise ValueError(f"--tokenizer-model {folder} holds no tokenizer files (one of "
                             f"{', '.join(TOKENIZER_FILES[:3])}, ...)")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                                      trust_remote_code=False)
        except Exception as err:  # noqa: BLE001 - transformers raises many types
            raise ValueError(f"--tokenizer-model {folder}: transformers cannot read it as a "
                             f"tokenizer ({first_line(err)})") from None
        if self._tok.eos_token_id is None:
            raise ValueError(f"--tokenizer-model {folder} defines no eos token to end "
                             "documents")
        self._folder = folder
        self.unique_identifiers = identity(self, tokenizer_model=os.path.abspath(folder))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._tok.eos_token_id

    @property
    def bos(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def pad(self) -> int | None:
        return self._tok.pad_token_id

    def tokenize(self, text: str) -> list[int]:
        # verbose=False: a document longer than the tokenizer's model_max_length is normal
        # here (the dataset cuts sequences), not worth transformers' warning
        return list(self._tok(text, verbose=False).input_ids)

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    def hf_files(self) -> HFTokenizerFiles:
        return HFTokenizerFiles({n: os.path.join(self._folder, n)
                                 for n in tokenizer_files(self._folder)})
