"""Ending the job when a rank stops: heartbeats through the launcher's store, and orphans.

A rank that *dies* is seen by ``torchrun`` at once. A rank that is *stopped* (SIGSTOP, a
frozen node, a process swapped out for good) is not: its peers wait in their next
collective until the process-group timeout, or forever in a gloo wait. And when the
``torchrun`` agent itself is killed, its workers are re-parented and keep training.

[Note: heartbeats]
Every rank runs a daemon thread that, every ``interval`` seconds, increments its counter in
the rendezvous store ``torchrun`` already runs (``MASTER_ADDR:MASTER_PORT``). A thread of a
busy rank keeps beating (long compute and collectives release the GIL); a stopped process
beats no more. Rank 0 watches every rank's counter; the others watch rank 0's. A counter
that has not moved for ``timeout`` seconds (measured on the watcher's own clock, so clocks
of different nodes need not agree) ends the watcher's process with one line naming the
silent rank; ``torchrun`` then ends the job (it stops the rest of that node's workers, and
the other nodes' watchers see rank 0 fall silent). Bound: a stopped rank ends the job within
``timeout + interval`` seconds, plus ``torchrun``'s own shutdown. The same thread exits a
worker whose parent (the agent) is gone, or whose store stopped answering.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

_PREFIX = "sdp4bit-heartbeat/"


def _stop(message: str) -> None:
    print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)  # from a thread: the main thread may be blocked in a collective


class Watchdog:
    """Start with :meth:`start`; runs until the process exits."""

    def __init__(self, store: dist.Store, rank: int, world: int, *, timeout: float,
                 interval: float) -> None:
        if timeout <= interval:
            raise ValueError(f"heartbeat timeout {timeout} s must exceed the interval "
                             f"{interval} s")
        self._store = store
        self._rank, self._world = rank, world
        self._timeout, self._interval = timeout, interval
        self._parent = os.getppid()
        self._watched = list(range(1, world)) if rank == 0 else [0]
        now = time.monotonic()
        self._last = {r: (None, now) for r in self._watched}  # counter, when it last moved

    def start(self) -> None:
        threading.Thread(target=self._run, name="sdp4bit-watchdog", daemon=True).start()

    def _run(self) -> None:
        beats = 0
        while True:
            if os.getppid() != self._parent:
                _stop(f"rank {self._rank}: the torchrun agent (pid {self._parent}) is gone; "
                      "stopping this worker")
            try:
                beats += 1
                self._store.set(f"{_PREFIX}{self._rank}", str(beats))
                self._check()
            except (RuntimeError, dist.DistError, OSError) as err:
                _stop(f"rank {self._rank}: the launcher's store stopped answering "
                      f"({type(err).__name__}); the job is ending")
            time.sleep(self._interval)

    def _check(self) -> None:
        now = time.monotonic()
        keys = [f"{_PREFIX}{r}" for r in self._watched]
        present = [r for r, k in zip(self._watched, keys) if self._store.check([k])]
        for r in present:
            value = self._store.get(f"{_PREFIX}{r}")
            counter, since = self._last[r]
            if value != counter:
                self._last[r] = (value, now)
        for r, (counter, since) in self._last.items():
            if now - since > self._timeout:
                state = "has sent no heartbeat" if counter is None else "stopped responding"
                _stop(f"rank {r} {state} for {now - since:.0f} s (stopped, frozen or "
                      f"unreachable; --heartbeat-timeout-seconds {self._timeout:g}): ending "
                      "the job")


def launcher_store(timeout_s: float) -> dist.Store | None:
    """A client of the store ``torchrun`` runs at ``MASTER_ADDR:MASTER_PORT``; None when
    this process was not started by ``torchrun`` (a world of one needs no watchdog)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"{os.environ['TORCHELASTIC_RUN_ID']}/", store)
