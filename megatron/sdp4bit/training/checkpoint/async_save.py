"""``--async-save``: torch_dist checkpoints written in the background, published when final.

A save at iteration N takes the checkpoint's state at once and hands the writing to
megatron-core's asynchronous writer (``integration/async_save.py``, [Note: the asynchronous
save]); training goes on. Nothing of the save is visible until its finalize step, which runs
on every rank once every rank's writer has exited: megatron-core's finalize (its write
results gathered, a failed write raised on every rank; ``.metadata``, ``metadata.json``),
then this trainer's (``torch_dist_format.publish``): the manifest with every file's SHA-256,
the rename of ``iter_N.partial`` to ``iter_N`` and the tracker, in that order.

When finalizing happens (the loop, ``training/loop.py``, Megatron-LM's points):

* at the start of every iteration, without waiting: the ranks agree (one all-reduce) whether
  every writer has exited, and finalize then;
* before the next save, waiting: one save is pending at a time;
* when training ends (``--train-iters``, ``--exit-interval``, ``--exit-duration-in-mins``,
  ``--exit-signal-handler``), waiting: the run exits, and releases ``--save``'s lock, only
  after its last checkpoint is published.

A run that fails (an error, a lost rank) kills its pending writers and publishes nothing: the
tracker still names the previous complete checkpoint and ``iter_N.partial`` is never loaded
(the next save of N replaces it). A process killed outright leaves the same; its writer is
killed with it (``megatron/sdp4bit/helper_processes.py``). The non-finite weights check and
the disk-space check run at scheduling, on the state the checkpoint holds.

A writer that ends badly (killed by a signal) or runs past its time limit fails the save on
every rank with one line naming the rank, the writer's pid, what happened and the save
(iteration and folder), at the check that finds it ([Note: waiting for the writer] in
``integration/async_save.py``). The limit is ``--async-save-timeout-seconds`` plus one
second for every :data:`WRITE_RATE_FLOOR` bytes the rank writes, counted from the fork: the
flag covers a slow start and a loaded file system, the size term a checkpoint that is
simply large.
"""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from torch.distributed.checkpoint.api import CheckpointException

from megatron.sdp4bit.integration.async_save import BackgroundWriter, WriterFailed
from megatron.sdp4bit.training.checkpoint import disk_space
from megatron.sdp4bit.training.guards import hooks

WRITE_RATE_FLOOR = 10 * 2**20
"""Bytes per second: the writer's time limit grows by one second per this many bytes the
rank writes (a slow shared file system's rate per writer)."""


class PendingSave(NamedTuple):
    """A save whose files are being written: where, and what its manifest records."""

    root: str  # --save
    partial: str  # the folder being written, renamed to iter_N when published
    iteration: int
    settings: dict[str, Any]  # the manifest's settings, taken at scheduling
    local_bytes: int = 0  # what this rank writes (its writer's time limit grows with it)


class AsyncSaves:
    """The run's scheduled saves, finalized in order (see the module docstring). Every method
    but ``close(abort=True)`` is a collective. ``timeout_seconds``:
    ``--async-save-timeout-seconds``."""

    def __init__(self, timeout_seconds: float, writer: BackgroundWriter | None = None) -> None:
        self._writer = writer if writer is not None else BackgroundWriter()
        self._timeout = timeout_seconds
        self._pending: list[PendingSave] = []

    @contextlib.contextmanager
    def strategy(self) -> Iterator[Any]:
        """megatron-core's save strategy for one ``dist_checkpointing.save(...,
        async_sharded_save=True)``."""
        with self._writer.strategy() as strategy:
            yield strategy

    def schedule(self, request: Any, save: PendingSave,
                 publish: Callable[[PendingSave], None]) -> None:
        """Start writing ``request`` (megatron-core's ``AsyncRequest`` of ``save``); ``publish``
        runs in its finalize step, after megatron-core's own finalize functions."""
        request.add_finalize_fn(lambda: publish(save))
        self._writer.schedule(request, limit=self.time_limit(save),
                              before_write=functools.partial(hooks.fire, "async-writer",
                                                             save.iteration))
        self._pending.append(save)

    def time_limit(self, save: PendingSave) -> float:
        """The seconds this rank's writer of ``save`` may run (see the module docstring)."""
        return self._timeout + save.local_bytes / WRITE_RATE_FLOOR

    @property
    def pending(self) -> list[int]:
        """The iterations scheduled and not published yet (the same on every rank)."""
        return [save.iteration for save in self._pending]

    def finalize(self, blocking: bool = False) -> list[int]:
        """Publish the saves whose writers have exited on every rank (``blocking``: wait for
        them, each at most its time limit); returns their iterations. A failed write, or a
        writer killed or past its limit, raises
        :class:`~megatron.sdp4bit.training.checkpoint.files.CheckpointError` on every rank
        (the partial folder removed, the previous checkpoint current)."""
        if not self._pending:  # nothing scheduled: no collective (every rank knows)
            return []
        try:
            done = self._writer.finalize(blocking)
        except WriterFailed as err:
            save = self._pending.pop(0)
            raise disk_space.failed_save(save.root, save.partial, save.iteration, err,
                                         cause=err.what(), fix=self._fix(err)) from err
        except CheckpointException as err:
            save = self._pending.pop(0)
            raise disk_space.failed_save(save.root, save.partial, save.iteration, err) from err
        published, self._pending = self._pending[:len(done)], self._pending[len(done):]
        return [save.iteration for save in published]

    @staticmethod
    def _fix(err: WriterFailed) -> str:
        if err.exitcode is None:
            return (f"the limit is --async-save-timeout-seconds plus 1 s per "
                    f"{WRITE_RATE_FLOOR >> 20} MiB the rank writes; a writer that runs this "
                    "long is stopped or its file system hangs: check it, raise the flag if "
                    "the file system is only slow, and restart the run")
        if err.exitcode == -signal.SIGKILL:
            return ("restart the run (a SIGKILL nobody sent is often the kernel's "
                    "out-of-memory killer: see dmesg)")
        return "restart the run"

    def close(self, abort: bool = False) -> list[int]:
        """Publish what is pending (waiting), or with ``abort`` (a failing run: not a
        collective) kill the pending writers and publish nothing; then stop the writer's
        helper process. Returns the iterations published."""
        published: list[int] = []
        try:
            if not abort:
                published = self.finalize(blocking=True)
        except BaseException:
            abort = True  # a failed finalize: nothing more is published
            raise
        finally:
            self._pending = []
            self._writer.close(abort=abort)
        return published
