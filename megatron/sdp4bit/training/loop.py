"""The training loop: the story of one training run, iteration by iteration.

Each concern is a piece of its own, called at its place in the story:

* the step (``step.py``: megatron-core's schedule, the optimizer, the skip of a non-finite
  step) and the count of skipped steps (``guards/skips.py``);
* what is reported (``metrics_step.py``: log lines, TensorBoard/W&B, the byte counters);
* evaluation (``step.evaluate``) every ``--eval-interval`` iterations, and on the test set
  once at the end;
* the replica check every ``--check-replicas-interval`` (``guards/replicas.py``);
* when to save (``checkpoint_policy.py``: interval, ramp-up steps, exits, the end,
  ``--async-save``'s publishing) and when to stop early (``guards/exit_conditions.py``);
* the profiler's window (``observe/profiler.py``);
* the points where the fault-injection tests act (``guards/hooks.py``; empty in a real run).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from megatron.sdp4bit.integration.lifecycle import SDP4BitLifecycle
from megatron.sdp4bit.integration.microbatches import current_batch, install_calculator
from megatron.sdp4bit.training.checkpoint_policy import CheckpointPolicy
from megatron.sdp4bit.training.data import chunk_iterators
from megatron.sdp4bit.training.guards import hooks
from megatron.sdp4bit.training.guards.exit_conditions import ExitPolicy
from megatron.sdp4bit.training.guards.exit_signal import ExitSignal
from megatron.sdp4bit.training.guards.replicas import check_replicas, gather_pending
from megatron.sdp4bit.training.guards.skips import TrainingStopped, check_progress, count_skip
from megatron.sdp4bit.training.metrics_step import MetricsStep
from megatron.sdp4bit.training.observe.logging import is_logging_rank
from megatron.sdp4bit.training.observe.profiler import ProfileWindow
from megatron.sdp4bit.training.observe.timers import Timers
from megatron.sdp4bit.training.step import evaluate, train_step

__all__ = ["TrainState", "TrainingStopped", "train"]


@dataclass
class TrainState:
    """Everything the loop works on; built by ``build.build_state``."""

    model: list  # megatron-core DistributedDataParallel chunks
    optimizer: Any
    scheduler: Any
    datasets: list  # [train, valid, test]
    vocab_size: int
    iteration: int = 0
    consumed_samples: int = 0
    lifecycle: SDP4BitLifecycle = field(default_factory=SDP4BitLifecycle)
    """SDP4Bit in this run (training/sdp4bit_setup.py): the iteration hooks, the bytes sent,
    the error-feedback state checkpoints hold."""
    first_loss: float | None = None
    first_loss_iteration: int | None = None
    last_loss: float | None = None
    last_val_loss: float | None = None
    last_test_loss: float | None = None
    timers: Timers | None = None
    """``--timing-log-level`` >= 1: megatron-core's and the trainer's phase timers."""
    settings: dict = field(default_factory=dict)
    """The run's layout, model shape and SDP4Bit settings, recorded in every checkpoint."""
    skipped_in_a_row: int = 0
    updated_steps: int = 0
    """Steps of this run (since start or resume) that changed the weights."""
    saved_iteration: int | None = None
    """The last checkpoint this run saved, and the last one known healthy: a step after it
    had finite gradients (weights blown up by a step look finite until the next forward)."""
    healthy_iteration: int | None = None


def train(args: argparse.Namespace, state: TrainState,
          exit_signal: ExitSignal | None = None) -> TrainState:
    """Run from ``state.iteration`` to ``--train-iters`` (or an early exit: ``--exit-interval``,
    ``--exit-duration-in-mins``, the iteration at whose end the ranks agree that
    ``exit_signal`` came). ``state.lifecycle`` starts SDP4Bit's iteration before each step
    (rounding streams, ``--gradients-quantization-start-iteration``) and hears of its end.

    With ``--async-save`` the pending save is published before this returns; a run that
    fails publishes nothing of it (``checkpoint/async_save.py``)."""
    checkpoints = CheckpointPolicy(args, state)
    try:
        _train(args, state, checkpoints, ExitPolicy(args, exit_signal))
    except TrainingStopped:  # every rank stops together: the last save is still good
        checkpoints.close()
        raise
    except BaseException:
        checkpoints.close(abort=True)
        raise
    checkpoints.close()
    return state


def _train(args: argparse.Namespace, state: TrainState, checkpoints: CheckpointPolicy,
           exits: ExitPolicy) -> None:
    # Each iteration's batch: megatron-core's calculator, from the consumed samples (so a
    # resumed run continues a --rampup-batch-size where it was)
    install_calculator(args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
                       _rampup(args), rank=dist.get_rank())
    train_iter = chunk_iterators(state.datasets[0], state.consumed_samples, args)
    evals_done = state.iteration // args.eval_interval
    valid_iter = chunk_iterators(state.datasets[1],  # evaluation: full global batches
                                 evals_done * args.eval_iters * args.global_batch_size, args,
                                 cycle=True)
    start_iteration = state.iteration
    metrics = MetricsStep(args, state)
    profiler = ProfileWindow(args)
    try:
        while state.iteration < args.train_iters:
            profiler.before_iteration(state.iteration)
            checkpoints.before_iteration()  # publish --async-save's finished saves
            state.lifecycle.start_iteration(state.iteration)
            batch_size, num_microbatches = current_batch(state.consumed_samples)
            loss, grad_norm, ok, num_zeros = train_step(args, state, train_iter,
                                                        num_microbatches)
            state.iteration += 1
            state.consumed_samples += batch_size
            profiler.after_iteration(state.iteration)
            count_skip(args, state, ok)
            metrics.after_step(loss, grad_norm, ok, num_zeros, batch_size, num_microbatches)
            if args.eval_interval and state.iteration % args.eval_interval == 0:
                metrics.evaluated(evaluate(args, state, valid_iter))
            hooks.fire("after-iteration", state)
            if args.check_replicas_interval and \
                    state.iteration % args.check_replicas_interval == 0:
                check_replicas(state.model, state.iteration, finish_gather=gather_pending(
                    args.overlap_param_gather, state.lifecycle.config.quantized_weights))
            checkpoints.after_iteration(num_microbatches)
            stop = exits.due(state.iteration)  # collective
            if stop is not None:
                done = checkpoints.before_exit(wait=stop.wait_for_save)
                if is_logging_rank():
                    print(f"{stop.line} ({done})" if stop.wait_for_save else stop.line,
                          flush=True)
                return
        checkpoints.at_end(start_iteration)
        check_progress(state, start_iteration)
        if args.test_data_path:  # Megatron-LM evaluates the test set once, at the end
            metrics.evaluated(evaluate(args, state, chunk_iterators(state.datasets[2], 0, args)),
                              split="test")
    finally:
        profiler.close()
        metrics.close()


def _rampup(args: argparse.Namespace) -> tuple[int, int, int] | None:
    return None if args.rampup_batch_size is None else tuple(args.rampup_batch_size)
