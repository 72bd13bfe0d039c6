"""The tests' corpora: a tiny GPT-2-format ``vocab.json`` + ``merges.txt`` trained on a few
lines (:func:`write_gpt2_vocab`), and megatron-core ``.bin``/``.idx`` pairs of given documents
(:func:`write_indexed_dataset`).

Hugging Face ``tokenizers`` trains a byte-level BPE and writes exactly GPT-2's two files;
all 256 byte symbols are in the vocabulary, so any text round-trips.
"""

from __future__ import annotations

from pathlib import Path

import numpy

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Sharded data parallelism moves gradients and weights between ranks.",
    "Quantization to four bits shrinks every message on the wire.",
    "Hello world! Unicode: caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c.",
] * 4


def write_gpt2_vocab(directory: Path, vocab_size: int = 300) -> tuple[str, str]:
    """Write ``vocab.json`` and ``merges.txt`` under ``directory``; return their paths."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(TEXT, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = tok.save_model(str(directory))
    return vocab, merges


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
