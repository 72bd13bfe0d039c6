"""megatron-core's asynchronous ``torch_dist`` save, as ``--async-save`` uses it.

:class:`BackgroundWriter` is megatron-core's own machinery, unchanged: the save strategy's
callbacks (``TorchDistSaveShardedStrategy``, the write in a forked process with
``FileSystemWriterAsync``), and ``AsyncCallsQueue`` with its default caller (a fresh
``fork`` per save, Megatron-LM's default) scheduling the request and finalizing it. This
module adds the lifetime of the processes, a bounded wait for the writer and the release
differences; the trainer's side
(what the finalize step publishes) is ``training/checkpoint/async_save.py``.

[Note: the asynchronous save]
``dist_checkpointing.save(..., async_sharded_save=True)`` does the synchronous part on the
spot: it plans the write (a collective), writes the small common state (0.16.1's
``common.pt``), and returns an ``AsyncRequest`` whose write function runs in a process
forked when the request is scheduled. What the checkpoint holds is fixed at that moment: the
RNG states, the error-feedback state and the other objects are serialised into the plan,
tensors that are views (the model's parameters live in megatron-core's flat buffers) are
copied, and the rest (the optimizer's fp32 shards and moments) is copied to the host by the
request's preload function and then frozen by the fork (the child sees the memory of the
moment it was forked; the training process goes on changing its own). The child reports its
write results through a queue that megatron-core makes with a ``spawn`` multiprocessing
manager the first time. ``maybe_finalize_async_calls`` asks every rank whether its writer
has exited (one all-reduce; ``blocking`` waits for it) and, once all have, runs the request's
finalize functions on every rank: megatron-core's (gather the write results, raising on
every rank if one failed; ``.metadata``; ``metadata.json``) and then the trainer's.

What differs here from Megatron-LM's use of it:

* the results queue is this object's: a manager started with the first save and shut down
  by :meth:`BackgroundWriter.close` (the trainer ends with ``os._exit``, which would leave
  megatron-core's own manager process running), set in place of megatron-core's module-level
  queue for the save's synchronous part, where its writer picks it up
  (``checkpoint.results_queue`` of the table). It is forked, not spawned as megatron-core's
  is (0.19's ``get_write_results_queue(mp_mode)`` leaves the choice to its caller): a spawned
  manager imports the main script again, and it slowed the first save down by 10 s on a
  loaded 2-core machine (4 ranks of ``pretrain_gpt.py``), 15 s in the 2-rank test
  (``tests/distributed/test_integration_async_save_writer.py``), against 0.3 s forked. It ends with the
  training process however that ends (``megatron/sdp4bit/helper_processes.py``), so the ``--save``
  lock it inherits is never held past the run. A spawned child runs the main script's
  top-level code again: in a script without an ``if __name__ == "__main__":`` guard the
  manager would run the training code instead of answering, and the save would wait for it;
  that, not torchrun, is the hang once blamed on megatron-core's writer (``pretrain_gpt.py``
  has the guard; with it a spawned manager works under torchrun too, only slower).
* ``torch.cuda.synchronize()``, which the scheduling calls after the preload, is a no-op in
  CPU mode (``cpu.cuda.synchronize``: there is no device work to wait for);
* megatron-core 0.19 defaults to nvidia-resiliency-ext's asynchronous writer (``"nvrx"``),
  which is not a requirement here: its own (``async_strategy="mcore"``) is asked for, the one
  0.16.1 has;
* every process of a save ends with the job ([Note: helper processes end with the job],
  ``megatron/sdp4bit/helper_processes.py``): the writer is started through
  :func:`_writer_main`, which makes the kernel kill it when the training process ends and
  makes every process it forks (0.16.1's per-bucket writers) die with it, and the results
  queue's manager does the same. :meth:`BackgroundWriter.close` with ``abort`` kills the
  pending writer and its children (megatron-core's ``close(abort=True)`` kills the writer
  only) and publishes nothing;
* the wait for a writer is bounded, and a writer that did not end well is named
  ([Note: waiting for the writer]).

[Note: waiting for the writer]
megatron-core's finalize asks whether every rank's writer is alive (one all-reduce) and,
when blocking, joins its own with no time limit; a writer that ended by a signal shows only
as an empty results queue in its finalize ("a rank could not write its files"). Here the
ranks agree first, with one small all-gather per check (in place of megatron-core's
all-reduce: a finished save costs megatron-core's own check once more): whether each rank's
writer is still running, since how long, its exit status and pid. A writer that exited with
a non-zero status (a signal: ``kill -9``, the out-of-memory killer) or that has run longer
than its time limit (stopped, or on a hung file system) fails the save on every rank at
once, naming the rank, the pid and what happened (:class:`WriterFailed`); every rank then
kills its own writer of that save with its children. A blocking wait polls every
:data:`POLL_S` seconds, so every rank reaches the all-gather while a slow writer is waited
for; megatron-core's finalize runs only once every writer has exited with status 0, and then
never waits. The time limit is the caller's (``--async-save-timeout-seconds``, scaled to the
bytes this rank writes: ``training/checkpoint/async_save.py``) and counts from the fork.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.managers import SyncManager
from typing import NamedTuple

import psutil
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from megatron.sdp4bit.helper_processes import (
    children_die_with_this_process,
    die_with_parent,
    exit_with_parent,
)
from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.dist_checkpointing import RESULTS_QUEUE

POLL_S = 1.0
"""A blocking wait's check interval ([Note: waiting for the writer])."""


class WriterFailed(RuntimeError):
    """A save's writer that ended with a non-zero status, or ran past its time limit, on
    some rank; raised on every rank alike ([Note: waiting for the writer]). ``exitcode``:
    None when the writer was still running after ``seconds`` (then killed), its limit being
    ``limit``; negative when a signal ended it (``multiprocessing``'s convention). ``ranks``:
    how many ranks' writers failed, ``rank`` being the first."""

    def __init__(self, rank: int, pid: int, exitcode: int | None, seconds: float,
                 limit: float, ranks: int = 1) -> None:
        self.rank, self.pid, self.exitcode = rank, pid, exitcode
        self.seconds, self.limit, self.ranks = seconds, limit, ranks
        super().__init__(self.what())

    def what(self) -> str:
        """What happened, in words: ``rank 1's checkpoint writer (pid 123) was killed by
        signal SIGKILL``."""
        who = f"rank {self.rank}'s checkpoint writer (pid {self.pid})"
        others = f" (and {self.ranks - 1} other rank(s)' writers)" if self.ranks > 1 else ""
        if self.exitcode is None:
            return (f"{who}{others} had not finished after {self.seconds:.1f} s, its time limit "
                    f"being {self.limit:.1f} s: it was killed")
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = str(-self.exitcode)
            return f"{who}{others} was killed by signal {name} before it finished"
        return f"{who}{others} exited with status {self.exitcode} before it finished"


class _Writer(NamedTuple):
    """This rank's writer process of one save (None: this rank has nothing to write)."""

    process: multiprocessing.Process | None
    started: float  # time.monotonic() at the fork
    limit: float  # seconds it may run


def _writer_main(parent: int, before_write: Callable[[], None] | None,
                 write: Callable[..., None], *args, **kwargs) -> None:
    """The writer process's entry point: dies with ``parent`` (the training process), makes
    what it forks die with it ([Note: helper processes end with the job]), then runs
    ``before_write`` (the fault-injection tests' hook point) and megatron-core's write."""
    die_with_parent(parent)
    children_die_with_this_process()
    if before_write is not None:
        before_write()
    write(*args, **kwargs)


def _kill_tree(process: multiprocessing.Process | None) -> None:
    """Kill a writer and every process it forked (SIGKILL ends a stopped one too); reap the
    writer, which is this process's child."""
    if process is None or process.pid is None:
        return
    try:
        writer = psutil.Process(process.pid)
        tree = [writer, *writer.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    deadline = time.monotonic() + 10
    while process.is_alive() and time.monotonic() < deadline:  # reaps it (waitpid)
        time.sleep(0.01)


def _gather(values: list[int]) -> list[list[int]]:
    """Collective: every rank's ``values`` (integers), in rank order."""
    # NCCL refuses host tensors: on the current device whenever there is one.
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [row.tolist() for row in rows]


def save_keywords() -> dict[str, str]:
    """The keywords of ``dist_checkpointing.save`` for megatron-core's own asynchronous
    writer: 0.19's ``async_strategy="mcore"`` (its default needs nvidia-resiliency-ext);
    0.16.1 has only that one and no keyword."""
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


class BackgroundWriter:
    """megatron-core's ``AsyncCallsQueue`` for this run's saves, one at a time, and the queue
    their writer processes report to (see [Note: the asynchronous save])."""

    def __init__(self) -> None:
        self._calls = AsyncCallsQueue(persistent=False)
        self._writer: _Writer | None = None
        self._manager = None
        self._results = None

    @contextlib.contextmanager
    def strategy(self) -> Iterator[TorchDistSaveShardedStrategy]:
        """megatron-core's torch_dist save strategy, its own callbacks (a forked writer),
        for one ``dist_checkpointing.save(..., async_sharded_save=True)``; one file per rank,
        as the synchronous save writes."""
        if self._manager is None:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))  # see the Note
            manager.start(initializer=exit_with_parent)
            self._manager, self._results = manager, manager.Queue()
        with patches.applied([RESULTS_QUEUE.on(results=self._results)]):
            yield TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)

    def schedule(self, request: AsyncRequest, limit: float,
                 before_write: Callable[[], None] | None = None) -> int:
        """Collective: fork the request's writer, which may run ``limit`` seconds
        (``before_write`` runs in it first); returns megatron-core's call index. One save at
        a time: the previous one must be finalized."""
        assert not self._calls.async_calls, "finalize the pending save before the next"
        if request.async_fn is not None:
            request = request._replace(async_fn=functools.partial(
                _writer_main, os.getpid(), before_write, request.async_fn))
        index = self._calls.schedule_async_request(request)
        process = getattr(self._calls.async_calls[-1].async_caller, "process", None)
        self._writer = _Writer(process, time.monotonic(), limit)
        return index

    def finalize(self, blocking: bool) -> list[int]:
        """Collective: finalize the pending save once its writers have exited on every rank
        (with ``blocking``, after waiting, at most its time limit); returns its call index,
        or nothing. Raises :class:`WriterFailed` (a writer ended badly or ran too long: then
        killed, nothing finalized) or what a finalize function raised (megatron-core's
        ``CheckpointException`` for a failed write), on every rank."""
        if not self._calls.async_calls:
            return []
        if not self._all_exited(blocking):
            return []
        self._writer = None
        # every writer has exited: megatron-core's blocking finalize does not wait
        return self._calls.maybe_finalize_async_calls(blocking=True, no_dist=False)

    def _all_exited(self, blocking: bool) -> bool:
        """Collective ([Note: waiting for the writer]): whether every rank's writer exited
        with status 0; raises :class:`WriterFailed` for one that did not, or ran too long."""
        writer = self._writer
        assert writer is not None
        process = writer.process
        while True:
            if blocking and process is not None and process.is_alive():
                left = writer.started + writer.limit - time.monotonic()
                process.join(timeout=min(POLL_S, max(left, 0.0)))
            alive = process is not None and process.is_alive()
            seconds = time.monotonic() - writer.started
            exitcode = 0 if process is None or alive else process.exitcode
            rows = _gather([int(alive), int(alive and seconds > writer.limit), exitcode or 0,
                            process.pid if process is not None else 0,
                            int(seconds * 1000), int(writer.limit * 1000)])
            failed = [rank for rank, row in enumerate(rows) if row[1] or (not row[0] and row[2])]
            if failed:
                self._abandon()
                _, overdue, code, pid, ms, limit_ms = rows[failed[0]]
                raise WriterFailed(failed[0], pid, None if overdue else code, ms / 1000,
                                   limit_ms / 1000, ranks=len(failed))
            if not any(row[0] for row in rows):
                return True
            if not blocking:
                return False

    def _abandon(self) -> None:
        """Collective: kill this rank's writer of the pending save (and its children) and
        drop the save; every rank has done so when this returns."""
        if self._writer is not None:
            _kill_tree(self._writer.process)
        self._calls.async_calls.clear()
        self._writer = None
        dist.barrier()  # no writer of the save is left when its partial folder is removed

    @property
    def pending(self) -> int:
        """Saves scheduled and not finalized (the same on every rank)."""
        return self._calls.get_num_unfinalized_calls()

    def close(self, abort: bool = False) -> None:
        """Finalize what is pending (a collective), or with ``abort`` kill the pending
        writer and its children without finalizing (not a collective: for a run that
        fails); then stop the results queue's manager."""
        try:
            if abort:
                if self._writer is not None:
                    _kill_tree(self._writer.process)
                self._calls.async_calls.clear()
                self._writer = None
            else:
                self.finalize(blocking=True)
        finally:
            if self._manager is not None:
                self._manager.shutdown()
                self._manager = self._results = None
