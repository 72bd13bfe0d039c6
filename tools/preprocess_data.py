#!/usr/bin/env python
"""Tokenize a JSON-lines corpus into megatron-core's ``.bin``/``.idx`` format.

Megatron-LM's flags: one document per line, ``{"text": "..."}`` by default; every key of
``--json-keys`` becomes ``{output_prefix}_{key}_document.bin/.idx``, read back by
``megatron.core.datasets.indexed_dataset.IndexedDataset`` and usable as ``--data-path
{output_prefix}_{key}_document``. Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 2

A malformed line stops the run with ``FILE:LINE: what is wrong`` and exit status 1; blank
lines are skipped; an input without a single document is an error. Progress goes to stderr
every ``--log-interval`` documents.

The pair is written under temporary names (``.bin.tmp``/``.idx.tmp``) and renamed into place
only when both are complete, ``.bin`` first: a failed or interrupted run leaves an existing
good pair as it was, and never a ``.bin`` and ``.idx`` that do not belong together.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence

import torch

# megatron-core warns on import that Transformer Engine/Apex are absent; neither is used here.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.sdp4bit.training.cli.arguments import TOKENIZER_TYPES  # noqa: E402
from megatron.sdp4bit.training.tokenizers import build_tokenizer  # noqa: E402


class InputError(ValueError):
    """A malformed input line; the message names the file and line."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    g.add_argument("--json-keys", "--columns", dest="json_keys", nargs="+", default=["text"],
                   help="keys to extract from every line (default: text)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=list(TOKENIZER_TYPES))
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    g.add_argument("--append-eod", action="store_true", help="end every document with EOD")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    return p


# Each worker process builds its tokenizer once (initializer), then encodes lines.
_worker: dict = {}


def _init_worker(args: argparse.Namespace) -> None:
    _worker["tok"] = build_tokenizer(args)
    _worker["args"] = args


def _encode(item: tuple[int, str]) -> tuple[int, dict[str, list[int]] | str, int]:
    """Encode one line; returns (line number, {key: ids} or an error message, bytes)."""
    line_no, line = item
    args, tok = _worker["args"], _worker["tok"]
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as err:
        return line_no, f"not valid JSON ({err.msg} at column {err.colno})", len(line)
    if not isinstance(doc, dict):
        return line_no, f"expected a JSON object, got {type(doc).__name__}", len(line)
    out: dict[str, list[int]] = {}
    for key in args.json_keys:
        if key not in doc:
            return line_no, f"missing key {key!r} (have {sorted(doc)[:5]})", len(line)
        text = doc[key]
        if not isinstance(text, str):
            return line_no, f"key {key!r} holds {type(text).__name__}, not a string", len(line)
        try:
            ids = tok.tokenize(text)
        except ValueError as err:
            return line_no, f"key {key!r}: {err}", len(line)
        if ids and args.append_eod:
            ids.append(tok.eod)
        out[key] = ids
    return line_no, out, len(line)


def _numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield line_no, line


def _output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def preprocess(args: argparse.Namespace) -> dict[str, int]:
    """Run the conversion; returns documents written per key. Raises :class:`InputError`."""
    if not os.path.isfile(args.input):
        raise InputError(f"--input {args.input}: no such file")
    if args.workers < 1:
        raise InputError(f"--workers={args.workers} must be >= 1")
    tok = build_tokenizer(args)  # fail fast on bad tokenizer flags, before any worker starts
    dtype = DType.optimal_dtype(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    finals = {k: _output_prefix(args.output_prefix, k) for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(finals[k] + ".bin.tmp", dtype=dtype)
                for k in args.json_keys}
    written = {k: 0 for k in args.json_keys}
    start, total_bytes, n_docs = time.time(), 0, 0

    pool = None
    if args.workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, (args,))
        results = pool.imap(_encode, _numbered_lines(args.input), chunksize=32)
    else:
        _init_worker(args)
        results = map(_encode, _numbered_lines(args.input))
    try:
        for line_no, encoded, n_bytes in results:
            if isinstance(encoded, str):
                raise InputError(f"{args.input}:{line_no}: {encoded}")
            for key, ids in encoded.items():
                if ids:  # an empty document carries no token: Megatron-LM skips it too
                    builders[key].add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                    written[key] += 1
            n_docs += 1
            total_bytes += n_bytes
            if n_docs % args.log_interval == 0:
                elapsed = max(time.time() - start, 1e-9)
                print(f"processed {n_docs} documents ({n_docs / elapsed:.1f} docs/s, "
                      f"{total_bytes / elapsed / 2**20:.2f} MB/s)", file=sys.stderr, flush=True)
        if n_docs == 0:
            raise InputError(f"--input {args.input} holds no document (no non-blank line)")
        for key, count in written.items():
            if count == 0:
                raise InputError(f"--input {args.input}: every {key!r} is empty, so "
                                 f"{finals[key]} would hold no document")
        for key, builder in builders.items():
            builder.finalize(finals[key] + ".idx.tmp")
        for key in args.json_keys:  # complete pairs only: .bin first, then its .idx
            os.replace(finals[key] + ".bin.tmp", finals[key] + ".bin")
            os.replace(finals[key] + ".idx.tmp", finals[key] + ".idx")
    finally:
        if pool is not None:
            pool.terminate()
        for key, builder in builders.items():
            builder.data_file.close()
            for suffix in (".bin.tmp", ".idx.tmp"):
                if os.path.exists(finals[key] + suffix):
                    os.remove(finals[key] + suffix)
    elapsed = max(time.time() - start, 1e-9)
    print(f"done: {n_docs} documents in {elapsed:.1f} s -> "
          + ", ".join(_output_prefix(args.output_prefix, k) for k in args.json_keys),
          file=sys.stderr, flush=True)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        preprocess(args)
    except ValueError as err:  # InputError and bad tokenizer files: one line, no traceback
        print(f"preprocess_data.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
