#!/usr/bin/env python
"""Tokenize a JSON-lines corpus into megatron-core's ``.bin``/``.idx`` format.

Megatron-LM's flags: one document per line, ``{"text": "..."}`` by default; every key of
``--json-keys`` becomes ``{output_prefix}_{key}_document.bin/.idx``, read back by
``megatron.core.datasets.indexed_dataset.IndexedDataset`` and usable as ``--data-path
{output_prefix}_{key}_document``. Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 2

A malformed line (not UTF-8, not JSON, a missing key) stops the run with ``FILE:LINE: what
is wrong`` (the column counts bytes of that line, from 1) and exit status 1; blank lines are
skipped; an input without a single document is an error. Progress goes to stderr every
``--log-interval`` documents.

The pair is written under fresh temporary names (``<name>.<random>.bin.tmp``/``.idx.tmp``)
and renamed into place only when both are complete (the old ``.idx`` removed first, then
``.bin`` and ``.idx`` renamed): a failed or interrupted run, a full disk included, leaves an
existing pair as it was and no temporary file, and never a ``.bin`` and ``.idx`` that do not
belong together. An existing pair is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence

import torch

# megatron-core warns on import that Transformer Engine/Apex are absent; neither is used here.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.sdp4bit.training.tokenizers import registry as tokenizer_registry  # noqa: E402
from megatron.sdp4bit.training.tokenizers.registry import build_tokenizer  # noqa: E402


class InputError(ValueError):
    """A malformed input line; the message names the file and line."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    g.add_argument("--json-keys", "--columns", dest="json_keys", nargs="+", default=["text"],
                   help="keys to extract from every line (default: text)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=list(tokenizer_registry.names()))
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    g.add_argument("--append-eod", action="store_true", help="end every document with EOD")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--overwrite", action="store_true",
                   help="replace existing .bin/.idx pairs of --output-prefix")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    return p


# Each worker process builds its tokenizer once (initializer), then encodes lines.
_worker: dict = {}


def _init_worker(args: argparse.Namespace) -> None:
    _worker["tok"] = build_tokenizer(args)
    _worker["args"] = args


def _encode(item: tuple[int, bytes]) -> tuple[int, dict[str, list[int]] | str, int]:
    """Encode one line; returns (line number, {key: ids} or an error message, bytes)."""
    line_no, raw = item
    args, tok = _worker["args"], _worker["tok"]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return (line_no, f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})",
                len(raw))
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


def _numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines as bytes: each is decoded where it is encoded, so that an invalid
    byte is reported with its own line and column."""
    with open(path, "rb") as f:
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
    finals = {k: _output_prefix(args.output_prefix, k) for k in args.json_keys}
    existing = [f + ext for f in finals.values() for ext in (".bin", ".idx")
                if os.path.lexists(f + ext)]
    if existing and not args.overwrite:
        raise InputError(f"--output-prefix {args.output_prefix}: {existing[0]} exists: pass "
                         "--overwrite to replace the pair, or choose another --output-prefix")
    written = {k: 0 for k in args.json_keys}
    start, total_bytes, n_docs = time.time(), 0, 0
    temps: list[str] = []
    builders: dict = {}
    pool = None
    try:
        os.makedirs(out_dir, exist_ok=True)
        tmp = {}
        for key, final in finals.items():
            for ext in (".bin", ".idx"):
                fd, tmp[key + ext] = tempfile.mkstemp(
                    dir=out_dir, prefix=os.path.basename(final) + ".", suffix=ext + ".tmp")
                os.close(fd)
                temps.append(tmp[key + ext])
            builders[key] = IndexedDatasetBuilder(tmp[key + ".bin"], dtype=dtype)
        if args.workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(args.workers, _init_worker, (args,))
            results = pool.imap(_encode, _numbered_lines(args.input), chunksize=32)
        else:
            _init_worker(args)
            results = map(_encode, _numbered_lines(args.input))
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
            builder.finalize(tmp[key + ".idx"])  # flushes and closes the .bin too
            for ext in (".bin", ".idx"):
                os.chmod(tmp[key + ext], 0o644)  # mkstemp's 0600 is for the unfinished file
        for key, final in finals.items():  # no moment with a .bin and a foreign .idx
            with contextlib.suppress(FileNotFoundError):
                os.remove(final + ".idx")
            os.replace(tmp[key + ".bin"], final + ".bin")
            os.replace(tmp[key + ".idx"], final + ".idx")
    except OSError as err:  # a full disk, an unwritable folder, an unreadable input
        where = err.filename if err.filename in (args.input, *temps) else out_dir
        what = ("cannot read --input " + args.input if where == args.input
                else f"cannot write --output-prefix {args.output_prefix}")
        raise InputError(f"{what} ({err.strerror or err}): free space or fix the folder; "
                         "an existing pair is left as it was") from None
    finally:
        if pool is not None:
            pool.terminate()
        for builder in builders.values():
            with contextlib.suppress(OSError):  # the disk that failed may fail the flush too
                builder.data_file.close()
        for path in temps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
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
