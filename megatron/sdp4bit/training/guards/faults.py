"""Fault injection for the reliability tests; nothing is installed unless ``SDP4BIT_FAULT``
is set.

``SDP4BIT_FAULT=KIND@ITERATION:RANK`` (several separated by commas) makes global rank RANK
misbehave at ITERATION, so that tests can prove what a real fault does to a run
(docs/reliability.md). :func:`install` puts each fault behind one of the run's hook points
(:mod:`megatron.sdp4bit.training.hooks`), which are empty otherwise:

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

import torch
import torch.distributed as dist

from megatron.sdp4bit.training.guards import hooks

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


def install() -> None:
    """Put the faults ``$SDP4BIT_FAULT`` asks for behind the run's hook points (nothing
    without it). Each hook checks, when its point is reached, whether its fault is due on
    this rank at this iteration."""
    specs = parse_env()
    kinds = {kind for kind, _, _ in specs}
    if "nan-grad" in kinds:
        hooks.add("loss", _nan_loss)
    if "nan-weight" in kinds:
        hooks.add("before-save", _nan_weight)
    if "flip-replica" in kinds:
        hooks.add("after-iteration", _flip_replica)
    if "die-saving" in kinds:
        hooks.add("save-files-written", _die)
    if "fill-disk-saving" in kinds:
        hooks.add("save-space-checked", _fill_disk_saving)


def _due(kind: str, iteration: int) -> bool:
    return active(kind, iteration, dist.get_rank())


def _nan_loss(loss: torch.Tensor, iteration: int) -> torch.Tensor:
    """``nan-grad``: the loss times NaN, so the backward fills this rank's gradients with NaN."""
    return loss * float("nan") if _due("nan-grad", iteration) else loss


def _first_weight(state) -> torch.Tensor:
    return next(state.model[0].parameters()).view(-1)


def _nan_weight(state) -> None:
    if _due("nan-weight", state.iteration):
        with torch.no_grad():
            _first_weight(state)[0] = float("nan")


def _flip_replica(state) -> None:
    if _due("flip-replica", state.iteration):
        with torch.no_grad():
            _first_weight(state)[0] += 1.0


def _die(iteration: int) -> None:
    if _due("die-saving", iteration):
        os._exit(17)


def _fill_disk_saving(root: str, iteration: int) -> None:
    if _due("fill-disk-saving", iteration):
        fill_disk(root)
