"""megatron-core's asynchronous ``torch_dist`` save, as ``--async-save`` uses it.

:class:`BackgroundWriter` is megatron-core's own machinery, unchanged: the save strategy's
callbacks (``TorchDistSaveShardedStrategy``, the write in a forked process with
``FileSystemWriterAsync``), and ``AsyncCallsQueue`` with its default caller (a fresh
``fork`` per save, Megatron-LM's default) scheduling the request and finalizing it. This
module adds the results queue's lifetime and the release differences; the trainer's side
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
  (``tests/distributed/test_async_save_writer.py``), against 0.3 s forked. It ends with the
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
* :meth:`BackgroundWriter.close` with ``abort`` kills the writer processes of the pending
  saves and the processes they forked (``AsyncCallsQueue.close(abort=True)`` leaves a
  fresh-fork writer running, and killing only the writer left 0.16.1's per-bucket child
  waiting forever for it): a run that fails leaves no process behind and publishes nothing.
  The manager ends with the training process however that ends
  (``megatron/sdp4bit/helper_processes.py``); a writer whose training process was killed
  finishes its files and exits.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
from collections.abc import Iterator
from multiprocessing.managers import SyncManager

import psutil

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from megatron.sdp4bit.helper_processes import exit_with_parent
from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.dist_checkpointing import RESULTS_QUEUE


def _kill_writer(caller) -> None:
    """Kill a pending save's writer and the processes it forked (0.16.1 writes each bucket
    from a child of the writer, which would wait forever for its killed parent)."""
    process = getattr(caller, "process", None)
    children = []
    if process is not None and process.pid is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            children = psutil.Process(process.pid).children(recursive=True)
    caller.close(abort=True)  # kills the writer and joins it
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=10)


def save_keywords() -> dict[str, str]:
    """The keywords of ``dist_checkpointing.save`` for megatron-core's own asynchronous
    writer: 0.19's ``async_strategy="mcore"`` (its default needs nvidia-resiliency-ext);
    0.16.1 has only that one and no keyword."""
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


class BackgroundWriter:
    """megatron-core's ``AsyncCallsQueue`` for this run's saves, and the queue their writer
    processes report to (see [Note: the asynchronous save])."""

    def __init__(self) -> None:
        self._calls = AsyncCallsQueue(persistent=False)
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

    def schedule(self, request: AsyncRequest) -> int:
        """Collective: fork the request's writer; returns megatron-core's call index."""
        return self._calls.schedule_async_request(request)

    def finalize(self, blocking: bool) -> list[int]:
        """Collective: finalize the saves whose writers have exited on every rank (with
        ``blocking``, all of them, after waiting); returns their call indices. Raises what a
        finalize function raised, on every rank (megatron-core's ``CheckpointException``
        for a failed write)."""
        return self._calls.maybe_finalize_async_calls(blocking=blocking, no_dist=False)

    @property
    def pending(self) -> int:
        """Saves scheduled and not finalized (the same on every rank)."""
        return self._calls.get_num_unfinalized_calls()

    def close(self, abort: bool = False) -> None:
        """Finalize what is pending (a collective), or with ``abort`` kill the pending
        writers without finalizing (not a collective: for a run that fails); then stop the
        results queue's manager."""
        if abort:
            for call in list(self._calls.async_calls):
                _kill_writer(call.async_caller)
            self._calls.async_calls.clear()
        else:
            self.finalize(blocking=True)
        if self._manager is not None:
            self._manager.shutdown()
            self._manager = self._results = None
