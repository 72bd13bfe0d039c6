"""The tests' corpora: a tiny GPT-2-format ``vocab.json`` + ``merges.txt`` trained on a few
lines (:func:`write_gpt2_vocab`, with the lines :data:`TEXT`: ``dev/tiny_runs.py``'s, which
the benchmarks share), megatron-core ``.bin``/``.idx`` pairs of given documents
(:func:`write_indexed_dataset`), a Hugging Face tokenizer folder and SentencePiece models
trained on the same lines.
"""

from __future__ import annotations

from pathlib import Path

import numpy

from dev.tiny_runs import TEXT, write_gpt2_vocab

__all__ = ["TEXT", "write_gpt2_vocab", "write_hf_tokenizer", "write_indexed_dataset",
           "write_sentencepiece"]


def write_indexed_dataset(tmp_path, docs=((1, 2, 3), (4, 5)), dtype=numpy.uint16) -> str:
    """A megatron-core .bin/.idx pair written by megatron-core's own builder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def write_hf_tokenizer(directory: Path, vocab_size: int = 300) -> str:
    """A Hugging Face tokenizer folder (``save_pretrained``'s ``tokenizer.json`` and
    ``tokenizer_config.json``): a byte-level BPE trained on :data:`TEXT` with ``<pad>``,
    ``<s>`` and ``</s>`` as ids 0, 1 and 2. Returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(str(directory))
    return str(directory)


def write_sentencepiece(path: Path, vocab_size: int = 300, llama_like: bool = True,
                        **options) -> str:
    """A SentencePiece model trained on :data:`TEXT` (``<unk>``, ``<s>``, ``</s>`` = 0, 1,
    2, no pad). ``llama_like``: as Llama's, BPE with byte fallback and no normalization
    (transformers' conversion of such a model gives the same ids); else sentencepiece's
    defaults (unigram, NFKC normalization, unknown characters -> ``<unk>``)."""
    import io

    import sentencepiece

    model = io.BytesIO()
    if llama_like:
        options = {"model_type": "bpe", "byte_fallback": True,
                   "normalization_rule_name": "identity", "remove_extra_whitespaces": False,
                   **options}
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=model, vocab_size=vocab_size,
        character_coverage=1.0, minloglevel=2, **options)
    path.write_bytes(model.getvalue())
    return str(path)
