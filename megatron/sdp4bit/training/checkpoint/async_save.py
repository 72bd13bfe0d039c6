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
(the next save of N replaces it). A process killed outright leaves the same, with its writer
finishing into ``.partial`` on its own. The non-finite weights check and the disk-space check
run at scheduling, on the state the checkpoint holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from torch.distributed.checkpoint.api import CheckpointException

from megatron.sdp4bit.integration.async_save import BackgroundWriter
from megatron.sdp4bit.training.checkpoint import disk_space


class PendingSave(NamedTuple):
    """A save whose files are being written: where, and what its manifest records."""

    root: str  # --save
    partial: str  # the folder being written, renamed to iter_N when published
    iteration: int
    settings: dict[str, Any]  # the manifest's settings, taken at scheduling


class AsyncSaves:
    """The run's scheduled saves, finalized in order (see the module docstring). Every method
    but ``close(abort=True)`` is a collective."""

    def __init__(self, writer: BackgroundWriter | None = None) -> None:
        self._writer = writer if writer is not None else BackgroundWriter()
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
        self._writer.schedule(request)
        self._pending.append(save)

    @property
    def pending(self) -> list[int]:
        """The iterations scheduled and not published yet (the same on every rank)."""
        return [save.iteration for save in self._pending]

    def finalize(self, blocking: bool = False) -> list[int]:
        """Publish the saves whose writers have exited on every rank (``blocking``: wait for
        all of them); returns their iterations. A failed write raises
        :class:`~megatron.sdp4bit.training.checkpoint.files.CheckpointError` on every rank
        (the partial folder removed, the previous checkpoint current)."""
        if not self._pending:  # nothing scheduled: no collective (every rank knows)
            return []
        try:
            done = self._writer.finalize(blocking)
        except CheckpointException as err:
            save = self._pending.pop(0)
            raise disk_space.failed_save(save.root, save.partial, save.iteration, err) from err
        published, self._pending = self._pending[:len(done)], self._pending[len(done):]
        return [save.iteration for save in published]

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
