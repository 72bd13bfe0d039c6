"""Tokenizers of Megatron-LM's ``--tokenizer-type``, one module per family, named in
:mod:`.registry` (one entry per tokenizer: its flags and special ids).

Each exposes ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]`` and
``detokenize(ids) -> str``, which is all megatron-core's ``GPTDataset`` and the
preprocessing tool need. The GPT-2 tokenizer is Hugging Face ``tokenizers``' byte-level
BPE over GPT-2's ``vocab.json``/``merges.txt``; SentencePiece is the ``sentencepiece``
package. Neither is reimplemented here.
"""

from __future__ import annotations

from megatron.sdp4bit.training.tokenizers.base import Tokenizer, padded_vocab_size
from megatron.sdp4bit.training.tokenizers.gpt2_bpe import GPT2_EOD, GPT2BPETokenizer
from megatron.sdp4bit.training.tokenizers.null import NullTokenizer
from megatron.sdp4bit.training.tokenizers.registry import REGISTRY, TokenizerSpec, build_tokenizer
from megatron.sdp4bit.training.tokenizers.sentence_piece import SentencePieceTokenizer

__all__ = ["GPT2_EOD", "GPT2BPETokenizer", "NullTokenizer", "REGISTRY", "SentencePieceTokenizer",
           "Tokenizer", "TokenizerSpec", "build_tokenizer", "padded_vocab_size"]
