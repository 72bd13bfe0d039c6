"""Every rank's first error reaches the console, once per job.

An error all ranks agree on (a preflight verdict, a stop every rank voted for) is printed
once, by rank 0. An error only one rank sees (a data file only it reads) is printed by
that rank, with its rank number: rank 0 may be blocked in a collective and never learn of
it. The ranks tell each other through the launcher's store: rank 0 prints, then writes the
message's key; another rank waits a few seconds for that key, stays quiet when it appears,
and prints otherwise (the first of the ranks that saw the same message, through an atomic
``add``). A lost connection to a peer is the consequence of that peer's failure: it stays
quiet when any rank has reported an error.
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch.distributed as dist

from megatron.sdp4bit.training.guards.watchdog import launcher_store

_PREFIX = "sdp4bit-errors/"
_ANY = _PREFIX + "any"
_STORE_ERRORS = (RuntimeError, dist.DistError, OSError)


def _print(message: str) -> None:
    print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)


def is_lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because a peer process went away."""
    text = str(err).lower()
    return isinstance(err, (RuntimeError, dist.DistError)) and any(s in text for s in (
        "connection closed by peer", "connection reset by peer", "broken pipe",
        "connection refused", "socket closed"))


def report(message: str, rank: int, *, lost_peer: bool = False, wait: float = 3.0,
           store: dist.Store | None = None) -> None:
    """Print ``message`` unless another rank already did ([module docstring]).

    ``store`` defaults to a client of torchrun's store; without one (no torchrun), rank 0
    prints and the other ranks stay quiet, as every rank then holds the same message.
    """
    if store is None:
        try:
            store = launcher_store(max(5.0, wait))
        except _STORE_ERRORS:
            store = None
    key = _PREFIX + hashlib.sha256(message.encode()).hexdigest()[:32]
    if rank == 0:
        if not lost_peer:
            _print(message)
        if store is not None:
            try:
                store.set(key, "0")
                store.add(_ANY, 1)
            except _STORE_ERRORS:
                pass
        if lost_peer:  # rank 0 lost a peer: the peer's own report comes first
            _report_if_alone(store, key, f"rank 0: {message}", lost_peer, wait)
        return
    _report_if_alone(store, key, f"rank {rank}: {message}", lost_peer, wait)


def _report_if_alone(store: dist.Store | None, key: str, line: str, lost_peer: bool,
                     wait: float) -> None:
    if store is None:
        time.sleep(wait)  # let rank 0's line out before torchrun stops the job
        return
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            if store.check([key]) or (lost_peer and store.check([_ANY])):
                return  # reported already
            time.sleep(0.1)
        if store.add(key + "/first", 1) == 1:
            _print(line)
            store.add(_ANY, 1)
    except _STORE_ERRORS:
        _print(line)  # no store to agree through: better twice than never
