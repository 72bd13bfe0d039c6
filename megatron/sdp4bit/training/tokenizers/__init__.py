"""Tokenizers of Megatron-LM's ``--tokenizer-type``, one module per family, named in
:mod:`.registry` (one entry per tokenizer: its flags and special ids).

Each exposes ``vocab_size``, ``eod``, ``bos``, ``pad``, ``tokenize(text) -> list[int]`` and
``detokenize(ids) -> str`` (megatron-core's ``GPTDataset`` and the preprocessing tool need
the first two and the last two), and what a Hugging Face export ships. The files are read by
the packages that define them: Hugging Face ``tokenizers`` (GPT-2's BPE), ``sentencepiece``
and ``transformers`` (a tokenizer folder). None is reimplemented here.
"""

from __future__ import annotations

from megatron.sdp4bit.training.tokenizers.base import Tokenizer, padded_vocab_size
from megatron.sdp4bit.training.tokenizers.gpt2_bpe import GPT2_EOD, GPT2BPETokenizer
from megatron.sdp4bit.training.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.sdp4bit.training.tokenizers.null import NullTokenizer
from megatron.sdp4bit.training.tokenizers.registry import REGISTRY, TokenizerSpec, build_tokenizer
from megatron.sdp4bit.training.tokenizers.sentence_piece import (
    GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer)

__all__ = ["GPT2_EOD", "GPT2BPETokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
           "Llama2Tokenizer", "NullTokenizer", "REGISTRY", "SentencePieceTokenizer", "Tokenizer",
           "TokenizerSpec", "build_tokenizer", "padded_vocab_size"]
