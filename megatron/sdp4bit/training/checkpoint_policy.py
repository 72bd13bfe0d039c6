"""When the run saves a checkpoint, and when ``--async-save``'s saves are published.

Megatron-LM's points, each at the end of an iteration:

* every ``--save-interval`` iterations;
* before a ``--rampup-batch-size`` step grows the batch (Megatron-LM saves when the
  micro-batch count changes, at the start of its next iteration; here once, when no other
  save just ran);
* before an early exit (``guards/exit_conditions.py``), unless this iteration was just saved;
* at the end of training, unless the last iteration was just saved.

With ``--overlap-param-gather`` each save first completes the step's parameter all-gather,
as Megatron-LM's trainer does, so that a checkpoint holds the synced replica.

A run that diverges saves nothing while its steps are being skipped (the last checkpoint is
the one from before the trouble). With ``--async-save`` the saves are written in the
background (``checkpoint/async_save.py``): finished ones are published at the start of each iteration
without waiting, and the policy waits for a pending one before the next save, before a
signal's exit and when training ends; a failing run publishes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist

from megatron.sdp4bit.integration.microbatches import current_batch
from megatron.sdp4bit.training.guards import hooks
from megatron.sdp4bit.training.checkpoint import formats
from megatron.sdp4bit.training.checkpoint.async_save import AsyncSaves
from megatron.sdp4bit.training.observe.logging import (
    format_saved,
    format_saving,
    format_scheduled,
    is_logging_rank,
)


class CheckpointPolicy:
    """The run's saves (collectives: every rank calls every method but ``close(abort=True)``).
    Records ``state.saved_iteration`` when a save is complete."""

    def __init__(self, args: argparse.Namespace, state) -> None:
        self._args = args
        self._state = state
        self.saves: AsyncSaves | None = (
            AsyncSaves(timeout_seconds=args.async_save_timeout_seconds)
            if args.async_save and args.save else None)
        """``--async-save``: the saves being written in the background."""
        self.saved_now = False
        """Whether the iteration that just ended was saved (by :meth:`after_iteration`)."""

    def before_iteration(self) -> None:
        """Publish the asynchronous saves every rank has finished writing (no wait)."""
        self._finalize(blocking=False)

    def after_iteration(self, num_microbatches: int) -> None:
        """``--save-interval``'s save, or the one before a batch-size ramp-up step
        (``num_microbatches``: the iteration's that just ran)."""
        args, state = self._args, self._state
        self.saved_now = False
        if not args.save:
            return
        interval = bool(args.save_interval) and state.iteration % args.save_interval == 0
        grows = (state.iteration < args.train_iters
                 and current_batch(state.consumed_samples)[1] != num_microbatches)
        if interval or grows:
            self.save()
            self.saved_now = True

    def before_exit(self, wait: bool) -> str:
        """Save this iteration unless it was just saved; ``wait``: until it is published.
        Returns what was done, in the words of the signal's exit line (which waits)."""
        args, state = self._args, self._state
        start = time.monotonic()
        if args.save and not self.saved_now:
            self.save()
        if wait:
            self._finalize(blocking=True)
        if not args.save:
            return "no --save: nothing saved"
        if state.saved_iteration != state.iteration:  # save() said why it did not
            return "this iteration not saved"
        if self.saved_now and self.saves is None:  # written by the interval's save
            return "checkpoint saved"
        # what the exit took: the save, or the wait for --async-save's to be published
        return f"checkpoint saved in {time.monotonic() - start:.1f} s"

    def at_end(self, start_iteration: int) -> None:
        """The last iteration's save, when this run trained and did not just save it."""
        if self._args.save and self._state.iteration > start_iteration and not self.saved_now:
            self.save()
            self.saved_now = True

    def save(self) -> None:
        """Save (or schedule) ``state.iteration``, unless the run is diverging."""
        args, state = self._args, self._state
        if state.skipped_in_a_row:  # diverging: keep the checkpoint from before the trouble
            if is_logging_rank():
                kept = (f"iteration {state.saved_iteration}" if state.saved_iteration is not None
                        else "the checkpoint it has")
                print(f"not saving iteration {state.iteration}: the last "
                      f"{state.skipped_in_a_row} iteration(s) were skipped (non-finite "
                      f"gradients); {args.save} keeps {kept}", flush=True)
            return
        hooks.fire("before-save", state)
        self._finalize(blocking=True)  # one asynchronous save in flight at a time
        # Megatron-LM's two lines, from rank 0 as there: cluster tooling waits for the second
        # (printed when an asynchronous save is published).
        if dist.get_rank() == 0:
            print(format_saving(state.iteration, args.save, args.ckpt_format), flush=True)
        if args.overlap_param_gather:
            # The step's all-gather is still pending: a checkpoint holds the synced replica,
            # as Megatron-LM saves it (and a resume is then bit-exact with qWD: param_sync.py,
            # [Note: a parameter sync sends each step once]).
            for chunk in state.model:
                chunk.start_param_sync(force_sync=True)
        formats.save(args, state.iteration, state.consumed_samples, state.model,
                     state.optimizer, state.scheduler, state.settings,
                     sdp4bit=state.lifecycle, background=self.saves)
        if self.saves is not None:
            if dist.get_rank() == 0:
                print(format_scheduled(state.iteration, args.save), flush=True)
            return
        self._saved(state.iteration)

    def close(self, abort: bool = False) -> None:
        """When training ends: publish the pending save (waiting), or with ``abort`` (a
        failing run; not a collective) kill its writer and publish nothing."""
        if self.saves is None:
            return
        saves, self.saves = self.saves, None
        for iteration in saves.close(abort=abort):
            self._saved(iteration)

    def _saved(self, iteration: int) -> None:
        self._state.saved_iteration = iteration
        if dist.get_rank() == 0:
            args = self._args
            print(format_saved(iteration, args.save, args.tensor_model_parallel_size,
                               args.pipeline_model_parallel_size), flush=True)

    def _finalize(self, blocking: bool) -> None:
        if self.saves is not None:
            for iteration in self.saves.finalize(blocking):
                self._saved(iteration)
