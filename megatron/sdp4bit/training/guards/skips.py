"""Steps skipped for non-finite gradients: said every time, counted, and a run that keeps
skipping (or never updates) stopped with one line naming the checkpoint to go back to.

The skip itself happens in :func:`megatron.sdp4bit.training.step.train_step` ([Note:
non-finite gradients] there); this module keeps the count the loop and the checkpoint policy
read (``state.skipped_in_a_row``, ``state.healthy_iteration``).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist


class TrainingStopped(RuntimeError):
    """The run cannot go on (non-finite gradients again and again); one line says why."""


def _is_logging_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1  # Megatron-LM's printing rank


def has_loss_scaler(optimizer) -> bool:
    """Whether megatron-core's optimizer has an fp16 loss scaler (which finds non-finite
    gradients itself and skips the step)."""
    return any(getattr(o, "grad_scaler", None) is not None
               for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _healthy_checkpoint(args: argparse.Namespace, state) -> str:
    if state.healthy_iteration is not None:
        return (f"resume from iteration {state.healthy_iteration} in {args.save} (the last "
                "checkpoint followed by a finite step) with a lower --lr")
    if state.saved_iteration is not None:
        return (f"no checkpoint of this run is known healthy (iteration "
                f"{state.saved_iteration} was followed by non-finite gradients): start again "
                "with a lower --lr or check the data")
    return "lower --lr or check the data"


def count_skip(args: argparse.Namespace, state, ok: bool) -> None:
    """After each step: say so when it was skipped for non-finite gradients; stop after
    ``--max-consecutive-skipped-iterations`` in a row (with a dynamic fp16 loss scale, skips
    while the scale is still coming down are how it calibrates: only those at
    ``--min-loss-scale`` count)."""
    if ok:
        state.skipped_in_a_row = 0
        state.updated_steps += 1
        if state.saved_iteration is not None and state.saved_iteration < state.iteration:
            state.healthy_iteration = state.saved_iteration
        return
    dynamic = has_loss_scaler(state.optimizer) and not args.loss_scale
    scale = state.optimizer.get_loss_scale().item()
    if dynamic and scale > args.min_loss_scale:
        if _is_logging_rank():  # how a dynamic scale calibrates; said, not counted
            print(f"skipped iteration {state.iteration}: fp16 gradients overflowed; the loss "
                  f"scale comes down (now {scale:g}); no weight changed", flush=True)
        return
    state.skipped_in_a_row += 1
    if _is_logging_rank():
        print(f"skipped iteration {state.iteration}: non-finite gradients (NaN or Inf) on some "
              "rank; no weight changed on any rank", flush=True)
    limit = args.max_consecutive_skipped_iterations
    if limit and state.skipped_in_a_row >= limit:
        raise TrainingStopped(
            f"stopping at iteration {state.iteration}: {state.skipped_in_a_row} iterations in "
            f"a row had non-finite gradients (loss scale {scale:g}); "
            f"{_healthy_checkpoint(args, state)} (--max-consecutive-skipped-iterations sets "
            "the limit)")


def check_progress(state, start_iteration: int) -> None:
    """At the end: a run none of whose steps changed the weights (e.g. a dynamic fp16 scale
    still far too high at the end) failed, even if no limit was reached on the way."""
    if state.iteration > start_iteration and state.updated_steps == 0:
        raise TrainingStopped(
            f"no iteration of this run updated the weights: all "
            f"{state.iteration - start_iteration} were skipped for non-finite gradients "
            f"(loss scale now {state.optimizer.get_loss_scale().item():g}); lower "
            "--initial-loss-scale or --lr, or check the data")
