"""Fault injection for the reliability tests; inert unless ``SDP4BIT_FAULT`` is set.

``SDP4BIT_FAULT=KIND@ITERATION:RANK`` (several separated by commas) makes global rank RANK
misbehave at ITERATION, so that tests can prove what a real fault does to a run
(docs/reliability.md):

* ``nan-grad``: this rank's loss of that iteration is multiplied by NaN, so its backward
  fills its gradients with NaN;
* ``die-saving``: while saving that iteration's checkpoint, the rank exits abruptly right
  after writing its own file (a crash in the middle of a save);
* ``nan-weight``: just before that iteration's checkpoint is saved, one weight of this
  rank becomes NaN (what a save must refuse to write);
* ``flip-replica``: after that iteration, one weight of this rank's model replica changes
  (a replica that drifted from the others', what ``--check-replicas-interval`` must catch);
* ``fill-disk-saving``: after the space check of that iteration's torch_dist save, the rank
  fills the file system of ``--save`` up to :data:`FILL_LEAVES` bytes (a disk that another
  job fills during the save): the small files still fit, the tensors do not.
"""

from __future__ import annotations

import functools
import os

ENV = "SDP4BIT_FAULT"
KINDS = ("nan-grad", "die-saving", "nan-weight", "flip-replica", "fill-disk-saving")
FILL_LEAVES = 64 << 10


@functools.lru_cache(maxsize=8)
def _parse(spec: str) -> frozenset[tuple[str, int, int]]:
    faults = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            kind, where = item.split("@")
            iteration, rank = where.split(":")
            faults.add((kind, int(iteration), int(rank)))
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: use KIND@ITERATION:RANK, KIND one of "
                             f"{', '.join(KINDS)}") from None
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r}; use one of {', '.join(KINDS)}")
    return frozenset(faults)


def parse_env() -> frozenset[tuple[str, int, int]]:
    """The faults ``$SDP4BIT_FAULT`` asks for; ValueError (one line) for a bad spec. The
    command-line check calls it, so a typo is reported before anything starts."""
    return _parse(os.environ.get(ENV, ""))


def active(kind: str, iteration: int, rank: int) -> bool:
    """Whether fault ``kind`` is requested for ``rank`` at ``iteration``."""
    return (kind, iteration, rank) in parse_env()


def fill_disk(folder: str) -> None:
    """``fill-disk-saving``: write ``folder/.fill`` until the file system is full, then give
    back :data:`FILL_LEAVES` bytes."""
    fd = os.open(os.path.join(folder, ".fill"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size, block = 0, b"\0" * (1 << 16)
        while True:
            try:
                size += os.write(fd, block)
            except OSError:
                break
        os.ftruncate(fd, max(0, size - FILL_LEAVES))
    finally:
        os.close(fd)
