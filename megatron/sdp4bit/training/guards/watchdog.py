"""Ending the job when a rank stops: heartbeats through the launcher's store, and orphans.

A rank that *dies* is seen by ``torchrun`` at once. A rank that is *stopped* (SIGSTOP, a
frozen node, a process swapped out for good) is not: its peers wait in their next
collective until the process-group timeout, or forever in a gloo wait. And when the
``torchrun`` agent itself is killed, its workers are re-parented and keep training.

[Note: heartbeats]
Every rank runs a daemon thread that, every ``interval`` seconds, writes its counter to
the rendezvous store ``torchrun`` already runs (``MASTER_ADDR:MASTER_PORT``). A thread of a
busy rank keeps beating (long compute and collectives release the GIL); a stopped process
beats no more. Rank 0 watches every rank's counter; the others watch rank 0's. A counter
that has not moved for ``timeout`` seconds (measured on the watcher's own clock, so clocks
of different nodes need not agree) ends the watcher's process with one line naming the
silent rank; ``torchrun`` then ends the job (it stops the rest of that node's workers, and
the other nodes' watchers see rank 0 fall silent). Bound: a stopped rank ends the job within
``timeout + interval`` seconds, plus ``torchrun``'s own shutdown.

Rank 0 reads the counters with ``multi_get`` in batches of ``_BATCH`` keys once every key
exists, so a sweep costs world/256 round trips instead of two per rank
(docs/reliability.md has the figures).

[Note: bounded store calls]
A store request whose peer vanished (a network partition, a stopped agent) can block in
a socket receive until the kernel gives up, many minutes later: TCPStore's own timeout
bounds some requests (``get``) but not others (``check``, ``multi_get``, ``add``). So the
store is used by one thread (the beater) and judged by another (the guard) that makes no
store call: when no round of beat-and-sweep has completed for ``timeout`` seconds, the
guard ends the process, whatever the beater is blocked in. A failed request is retried at
the next beat (after reconnecting, when a ``connect`` function was given); only a store
silent for ``timeout`` seconds ends the job. The guard also ends a worker whose parent
(the ``torchrun`` agent) is gone.

[Note: watchdog shutdown]
:meth:`Watchdog.stop` must run before the interpreter exits: a daemon thread still inside
a store call at exit is ended by the interpreter with ``pthread_exit``, whose unwinding
through the C++ frames of that call aborts the process (``terminate called without an
active exception``, SIGABRT) after the run's work is done. ``stop`` also marks this rank
as finished in the store, so that a watcher does not take a rank that ended first for a
stopped one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

_PREFIX = "sdp4bit-heartbeat/"
_NONE = b""  # a counter rank 0 created and its rank has not written yet
_DONE = b"done"  # written by a rank whose watchdog was stopped: it finished, not froze
_STORE_ERRORS = (RuntimeError, dist.DistError, OSError)
# Keys per multi_get/multi_set/check request. The store's time per request grows faster
# than its key count (16,384 keys in one multi_get: tens of seconds on loopback), so a
# sweep sends batches: 256 keys cost about what one key does (docs/reliability.md).
_BATCH = 256


def _stop(message: str) -> None:
    print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)  # from a thread: the main thread may be blocked in a collective


def _key(rank: int) -> str:
    return f"{_PREFIX}{rank}"


class Watchdog:
    """Start with :meth:`start`, end with :meth:`stop` before the process exits."""

    def __init__(self, store: dist.Store, rank: int, world: int, *, timeout: float,
                 interval: float, connect: Callable[[], dist.Store] | None = None) -> None:
        if timeout <= interval:
            raise ValueError(f"heartbeat timeout {timeout} s must exceed the interval "
                             f"{interval} s")
        self._store, self._connect = store, connect
        self._rank, self._world = rank, world
        self._timeout, self._interval = timeout, interval
        self._parent = os.getppid()
        self._watched = list(range(1, world)) if rank == 0 else [0]
        now = time.monotonic()
        self._last = {r: (None, now) for r in self._watched}  # counter, when it last moved
        self._seen: set[int] = set()  # watched ranks whose key exists in the store
        self._beats = 0
        self._answered = now  # when a beat-and-sweep round last completed
        self._error: BaseException | None = None  # the last failed request's error
        self._stopping = threading.Event()
        self._beater_done = threading.Event()  # wakes the guard at once when the beater ends
        self._beater: threading.Thread | None = None
        self._guard: threading.Thread | None = None

    def start(self) -> None:
        self._beater = threading.Thread(target=self._beat_loop, name="sdp4bit-heartbeat",
                                        daemon=True)
        self._guard = threading.Thread(target=self._guard_loop, name="sdp4bit-watchdog",
                                       daemon=True)
        self._beater.start()
        self._guard.start()

    def stop(self) -> bool:
        """End both threads in order and wait for them ([Note: watchdog shutdown]); True
        when both ended. A beater blocked in the store is bounded by the guard, which ends
        the process ``timeout`` seconds after the store's last answer."""
        self._stopping.set()
        deadline = time.monotonic() + self._timeout + 2 * self._interval
        for thread in (self._beater, self._guard):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t is not None and t.is_alive() for t in (self._beater, self._guard))

    def _beat_loop(self) -> None:
        try:
            if self._rank == 0:
                self._retry(self._create_counters)
            while not self._stopping.is_set():
                self._retry(self._round)
                self._stopping.wait(self._interval)
            try:
                self._store.set(_key(self._rank), _DONE)
            except _STORE_ERRORS:
                pass  # the watchers will call this rank silent: the store is gone anyway
        finally:
            self._beater_done.set()

    def _retry(self, request: Callable[[], None]) -> None:
        """One attempt; a failure is kept for the guard's message and retried at the next
        beat, on a new connection when possible."""
        try:
            request()
            self._answered, self._error = time.monotonic(), None
        except _STORE_ERRORS as err:
            self._error = err
            if self._connect is not None:
                try:
                    self._store = self._connect()
                except _STORE_ERRORS:
                    pass

    def _guard_loop(self) -> None:
        # Runs until the beater has ended, so that a beater blocked at shutdown is bounded.
        period = self._interval / 2
        while not self._beater_done.is_set():
            if os.getppid() != self._parent:
                _stop(f"rank {self._rank}: the torchrun agent (pid {self._parent}) is gone; "
                      "stopping this worker")
                return
            silent = time.monotonic() - self._answered
            if silent > self._timeout:
                why = (f"the last request failed: {type(self._error).__name__}"
                       if self._error is not None else "a request is blocked")
                _stop(f"rank {self._rank}: the launcher's store has not answered for "
                      f"{silent:.0f} s ({why}; a network partition, or the torchrun agent "
                      f"is stopped; --heartbeat-timeout-seconds {self._timeout:g}): ending "
                      "the job")
                return
            self._beater_done.wait(period)

    def _create_counters(self) -> None:
        # Every counter exists from the start, so that one multi_get reads them all (a
        # multi_get of a missing key waits for it). A rank's beat this overwrites is
        # rewritten at its next beat.
        for batch in _batches(self._watched):
            self._store.multi_set([_key(r) for r in batch], [_NONE] * len(batch))
        self._seen.update(self._watched)

    def _round(self) -> None:
        self._beats += 1
        self._store.set(_key(self._rank), str(self._beats))
        self._check()

    def _check(self) -> None:
        missing = [r for r in self._last if r not in self._seen]
        for batch in _batches(missing):
            if self._store.check([_key(r) for r in batch]):
                self._seen.update(batch)
        watched = [r for r in self._last if r in self._seen]
        values = [v for batch in _batches(watched)
                  for v in self._store.multi_get([_key(r) for r in batch])]
        now = time.monotonic()
        for r, value in zip(watched, values):
            if value == _DONE:
                del self._last[r]  # finished: nothing more to watch
                continue
            counter, since = self._last[r]
            if value != _NONE and value != counter:
                self._last[r] = (value, now)
        for r, (counter, since) in self._last.items():
            if now - since > self._timeout:
                state = "has sent no heartbeat" if counter is None else "stopped responding"
                _stop(f"rank {r} {state} for {now - since:.0f} s (stopped, frozen or "
                      f"unreachable; --heartbeat-timeout-seconds {self._timeout:g}): ending "
                      "the job")


def _batches(ranks: list[int]) -> list[list[int]]:
    return [ranks[i:i + _BATCH] for i in range(0, len(ranks), _BATCH)]


def launcher_store(timeout_s: float) -> dist.Store | None:
    """A client of the store ``torchrun`` runs at ``MASTER_ADDR:MASTER_PORT``, its requests
    timed out after ``timeout_s``; None when this process was not started by ``torchrun``
    (a world of one needs no watchdog). The keys are this launch's: a restarted job (a
    new restart count) does not read the counters of the attempt before."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{os.environ['TORCHELASTIC_RUN_ID']}/{attempt}/", store)
