"""The training loop: steps (:mod:`.step`), LR schedule, evaluation, logging, checkpoints,
``--exit-interval``, ``--exit-signal-handler``, skipped steps and the replica check."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron.sdp4bit.comm.stats import CommStats
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration.microbatches import current_batch, install_calculator
from megatron.sdp4bit.integration.params_norm import params_l2_norm
from megatron.sdp4bit.training.checkpoint import formats as checkpoint_formats
from megatron.sdp4bit.training.checkpoint.async_save import AsyncSaves
from megatron.sdp4bit.training.guards import faults
from megatron.sdp4bit.training.guards.exit_conditions import exit_duration_reached
from megatron.sdp4bit.training.guards.exit_signal import ExitSignal
from megatron.sdp4bit.training.observe.moe_metrics import MoELosses
from megatron.sdp4bit.training.observe.comm_counters import (
    ExpertLayout,
    add_unquantized_iteration,
    snapshot_fields,
)
from megatron.sdp4bit.training.data import chunk_iterators
from megatron.sdp4bit.training.observe.logging import (
    format_eval_lines,
    format_saved,
    format_saving,
    format_scheduled,
    format_train_line,
)
from megatron.sdp4bit.training.observe.memory import memory_scalars
from megatron.sdp4bit.training.observe.metrics_writer import MetricsWriter
from megatron.sdp4bit.training.observe.profiler import ProfileWindow
from megatron.sdp4bit.training.guards.replicas import check_replicas, gather_pending
from megatron.sdp4bit.training.step import evaluate, has_loss_scaler, train_step
from megatron.sdp4bit.training.observe.timers import Timers, format_timers, max_times


@dataclass
class TrainState:
    """Everything the loop works on; built by :mod:`megatron.sdp4bit.training.setup`."""

    model: list  # megatron-core DistributedDataParallel chunks
    optimizer: Any
    scheduler: Any
    datasets: list  # [train, valid, test]
    vocab_size: int
    iteration: int = 0
    consumed_samples: int = 0
    comm_stats: CommStats = field(default_factory=CommStats)
    sdp4bit: SDP4BitConfig = field(default_factory=SDP4BitConfig)
    """What SDP4Bit replaces; its collectives count their own bytes, the rest is added here."""
    ranks_per_node: int = 1
    expert_layout: ExpertLayout | None = None
    """MoE: the expert data-parallel group, for the byte accounting of the expert buckets."""
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
    sdp4bit_handle: Any = None
    """The installed SDP4Bit (None without): checkpoints hold its per-rank error-feedback
    state."""
    async_saves: AsyncSaves | None = None
    """``--async-save``: the saves being written in the background (set by :func:`train`)."""


class TrainingStopped(RuntimeError):
    """The run cannot go on (non-finite gradients again and again); one line says why."""


def _flops_per_iteration(args: argparse.Namespace, vocab: int, batch_size: int) -> float:
    """Model FLOPs of one training iteration of ``batch_size`` samples (forward + backward =
    3 x forward matmuls)."""
    h, s, L, f = args.hidden_size, args.seq_length, args.num_layers, args.ffn_hidden_size
    mlp = (3 if args.swiglu else 2) * h * f
    per_token = L * (2 * (4 * h * h + mlp) + 4 * s * h) + 2 * h * vocab
    return 3.0 * per_token * batch_size * s


def _rampup(args: argparse.Namespace) -> tuple[int, int, int] | None:
    rampup = getattr(args, "rampup_batch_size", None)
    return None if rampup is None else tuple(rampup)


def _is_logging_rank() -> bool:
    # Megatron-LM prints from the last rank: it holds the loss with pipeline parallelism.
    return dist.get_rank() == dist.get_world_size() - 1


def _save(args, state: TrainState) -> None:
    if state.skipped_in_a_row:  # diverging: keep the checkpoint from before the trouble
        if _is_logging_rank():
            kept = (f"iteration {state.saved_iteration}" if state.saved_iteration is not None
                    else "the checkpoint it has")
            print(f"not saving iteration {state.iteration}: the last {state.skipped_in_a_row} "
                  f"iteration(s) were skipped (non-finite gradients); {args.save} keeps "
                  f"{kept}", flush=True)
        return
    if faults.active("nan-weight", state.iteration, dist.get_rank()):
        with torch.no_grad():
            next(state.model[0].parameters()).view(-1)[0] = float("nan")
    if state.async_saves is not None:  # one save in flight at a time
        _finalize_saves(args, state, blocking=True)
    # Megatron-LM's two lines, from rank 0 as there: cluster tooling waits for the second
    # (printed when an asynchronous save is published).
    if dist.get_rank() == 0:
        print(format_saving(state.iteration, args.save, args.ckpt_format), flush=True)
    checkpoint_formats.save(args, state.iteration, state.consumed_samples, state.model,
                            state.optimizer, state.scheduler, state.settings,
                            sdp4bit_handle=state.sdp4bit_handle, background=state.async_saves)
    if state.async_saves is not None:
        if dist.get_rank() == 0:
            print(format_scheduled(state.iteration, args.save), flush=True)
        return
    _saved(args, state, state.iteration)


def _saved(args, state: TrainState, iteration: int) -> None:
    state.saved_iteration = iteration
    if dist.get_rank() == 0:
        print(format_saved(iteration, args.save, args.tensor_model_parallel_size,
                           args.pipeline_model_parallel_size), flush=True)


def _finalize_saves(args, state: TrainState, blocking: bool) -> None:
    """Collective (``--async-save``): publish the saves whose writers have finished on every
    rank; ``blocking``: wait for all (training/checkpoint/async_save.py)."""
    if state.async_saves is not None:
        for iteration in state.async_saves.finalize(blocking):
            _saved(args, state, iteration)


def _exit_on_signal(args, state: TrainState, signal: ExitSignal, saved: bool) -> None:
    """Every rank agreed that the signal came: save this iteration (unless just saved)."""
    start = time.monotonic()
    if args.save and not saved:
        _save(args, state)
    _finalize_saves(args, state, blocking=True)  # the exit waits for an asynchronous save
    if _is_logging_rank():
        if not args.save:
            done = "no --save: nothing saved"
        elif state.saved_iteration != state.iteration:  # _save said why it did not
            done = "this iteration not saved"
        else:
            done = ("checkpoint saved" if saved
                    else f"checkpoint saved in {time.monotonic() - start:.1f} s")
        print(f"exiting program after receiving {signal.name} at iteration "
              f"{state.iteration} ({done})", flush=True)


def _healthy_checkpoint(args, state: TrainState) -> str:
    if state.healthy_iteration is not None:
        return (f"resume from iteration {state.healthy_iteration} in {args.save} (the last "
                "checkpoint followed by a finite step) with a lower --lr")
    if state.saved_iteration is not None:
        return (f"no checkpoint of this run is known healthy (iteration "
                f"{state.saved_iteration} was followed by non-finite gradients): start again "
                "with a lower --lr or check the data")
    return "lower --lr or check the data"


def _count_skip(args, state: TrainState, ok: bool) -> None:
    """Say so when a step was skipped for non-finite gradients; stop after too many in a row
    (with a dynamic fp16 loss scale, skips while the scale is still coming down are how it
    calibrates: only those at --min-loss-scale count)."""
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


def _check_progress(state: TrainState, start_iteration: int) -> None:
    """A run none of whose steps changed the weights (e.g. a dynamic fp16 scale still far too
    high at the end) failed, even if no limit was reached on the way."""
    if state.iteration > start_iteration and state.updated_steps == 0:
        raise TrainingStopped(
            f"no iteration of this run updated the weights: all "
            f"{state.iteration - start_iteration} were skipped for non-finite gradients "
            f"(loss scale now {state.optimizer.get_loss_scale().item():g}); lower "
            "--initial-loss-scale or --lr, or check the data")


def train(args: argparse.Namespace, state: TrainState, on_iteration=None,
          exit_signal: ExitSignal | None = None) -> TrainState:
    """:func:`_train`, and with ``--async-save`` its saves' background writing: the pending
    save is published before this returns; a run that fails publishes nothing of it
    (training/checkpoint/async_save.py)."""
    state.async_saves = AsyncSaves() if args.async_save and args.save else None
    try:
        _train(args, state, on_iteration, exit_signal)
    except TrainingStopped:  # every rank stops together: the last save is still good
        _close_saves(args, state)
        raise
    except BaseException:
        if state.async_saves is not None:
            state.async_saves.close(abort=True)
            state.async_saves = None
        raise
    _close_saves(args, state)
    return state


def _close_saves(args, state: TrainState) -> None:
    if state.async_saves is not None:
        for iteration in state.async_saves.close():
            _saved(args, state, iteration)
        state.async_saves = None


def _train(args: argparse.Namespace, state: TrainState, on_iteration=None,
           exit_signal: ExitSignal | None = None) -> TrainState:
    """Run from ``state.iteration`` to ``--train-iters`` (or ``--exit-interval``, or the
    iteration at whose end the ranks agree that ``exit_signal`` came).

    ``on_iteration(iteration)`` runs before each step (SDP4Bit uses it to start gradient
    quantization at ``--gradients-quantization-start-iteration``).
    """
    metrics = MetricsWriter(args) if _is_logging_rank() else None
    # Each iteration's batch: megatron-core's calculator, from the consumed samples (so a
    # resumed run continues a --rampup-batch-size where it was)
    install_calculator(args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
                       _rampup(args), rank=dist.get_rank())
    train_iter = chunk_iterators(state.datasets[0], state.consumed_samples, args)
    evals_done = state.iteration // args.eval_interval
    valid_iter = chunk_iterators(state.datasets[1],  # evaluation: full global batches
                                 evals_done * args.eval_iters * args.global_batch_size, args,
                                 cycle=True)
    skipped = nan_iters = 0
    start_iteration = state.iteration
    window_loss, window_iters, window_start = 0.0, 0, time.time()
    moe_losses = MoELosses(args)
    profiler = ProfileWindow(args)
    try:
        while state.iteration < args.train_iters:
            profiler.before_iteration(state.iteration)
            _finalize_saves(args, state, blocking=False)  # --async-save's finished saves
            if on_iteration is not None:
                on_iteration(state.iteration)
            gbs, num_microbatches = current_batch(state.consumed_samples)
            loss, grad_norm, ok, num_zeros = train_step(args, state, train_iter,
                                                        num_microbatches)
            # Megatron-LM computes it every iteration, on every rank (collective)
            params_norm = (params_l2_norm(state.model, args.bf16) if args.log_params_norm
                           else None)
            q = state.sdp4bit
            add_unquantized_iteration(
                state.comm_stats, state.model, dp_size=args.data_parallel_size,
                ranks_per_node=state.ranks_per_node,
                distributed_optimizer=args.use_distributed_optimizer,
                params=not q.quantized_weights,
                grads=not q.quantized_gradients
                or state.iteration < q.gradients_quantization_start_iteration,
                expert=state.expert_layout)
            state.iteration += 1
            profiler.after_iteration(state.iteration)
            moe_losses.after_iteration(state.iteration, num_microbatches)
            state.consumed_samples += gbs
            skipped += 0 if ok else 1
            nan_iters += 0 if loss == loss else 1
            _count_skip(args, state, ok)
            if state.first_loss is None:
                state.first_loss, state.first_loss_iteration = loss, state.iteration
            state.last_loss = loss
            window_loss += loss
            window_iters += 1
            if metrics is not None and metrics.iteration_due(state.iteration):
                # Megatron-LM's per-iteration TensorBoard/W&B scalars
                metrics.iteration(state.iteration, state.consumed_samples, loss,
                                  state.optimizer.param_groups[0]["lr"],
                                  state.optimizer.get_loss_scale().item(), float(grad_norm),
                                  num_zeros=num_zeros, params_norm=params_norm,
                                  batch_size=gbs)
            if state.iteration % args.log_interval == 0:
                elapsed = (time.time() - window_start) / window_iters
                comm = snapshot_fields(state.comm_stats, window_iters, expert=None if
                                       state.expert_layout is None else state.expert_layout.stats)
                record = {
                    "iteration": state.iteration, "train_iters": args.train_iters,
                    "time": round(time.time(), 3),
                    "consumed_samples": state.consumed_samples, "elapsed_ms": elapsed * 1e3,
                    "tflops_per_gpu": _flops_per_iteration(args, state.vocab_size, gbs)
                    / (elapsed * args.world_size * 1e12),
                    "learning_rate": state.optimizer.param_groups[0]["lr"],
                    "global_batch_size": gbs, "lm_loss": window_loss / window_iters,
                    "loss_scale": state.optimizer.get_loss_scale().item(),
                    "grad_norm": float(grad_norm), "skipped_iterations": skipped,
                    "nan_iterations": nan_iters, **comm, **moe_losses.take(window_iters),
                }
                # this iteration's values, as Megatron-LM's line shows them
                if args.log_num_zeros_in_grad:
                    record["num_zeros"] = num_zeros
                if params_norm is not None:
                    record["params_norm"] = params_norm
                if args.log_memory_to_tensorboard and metrics is not None:
                    record["memory"] = memory_scalars()
                timer_block = None
                if state.timers is not None:  # collective: every rank takes part
                    for phase, seconds in state.comm_stats.take_seconds().items():
                        state.timers.add(f"sdp4bit-{phase}", seconds)
                    times = state.timers.collect(normalizer=window_iters)
                    record["timers_ms"] = max_times(times)
                    timer_block = format_timers(times, args.timing_log_option)
                if metrics is not None:
                    print(format_train_line(record), flush=True)
                    if timer_block:
                        print(timer_block, flush=True)
                    metrics.train(record)
                skipped = nan_iters = 0
                window_loss, window_iters, window_start = 0.0, 0, time.time()
            if args.eval_interval and state.iteration % args.eval_interval == 0:
                val = evaluate(args, state, valid_iter)
                if val is not None:
                    state.last_val_loss = val
                    if metrics is not None:
                        print(format_eval_lines(state.iteration, val), flush=True)
                        metrics.evaluation(state.iteration, state.consumed_samples, val)
                window_start = time.time()  # evaluation time is not iteration time
            if faults.active("flip-replica", state.iteration, dist.get_rank()):
                with torch.no_grad():
                    next(state.model[0].parameters()).view(-1)[0] += 1.0
            if args.check_replicas_interval and \
                    state.iteration % args.check_replicas_interval == 0:
                check_replicas(state.model, state.iteration, finish_gather=gather_pending(
                    args.overlap_param_gather, state.sdp4bit.quantized_weights))
            saved = False
            if args.save and args.save_interval and state.iteration % args.save_interval == 0:
                _save(args, state)
                saved = True
            # Megatron-LM saves when a --rampup-batch-size is about to grow the batch (at the
            # start of its next iteration there; once here, when no other save just ran)
            if (args.save and not saved and state.iteration < args.train_iters
                    and current_batch(state.consumed_samples)[1] != num_microbatches):
                _save(args, state)
                saved = True
            if exit_signal is not None and exit_signal.agreed():  # collective
                _exit_on_signal(args, state, exit_signal, saved)
                return state
            if args.exit_interval and state.iteration % args.exit_interval == 0:
                if args.save and not saved:
                    _save(args, state)
                if metrics is not None:
                    print(f"exiting program at iteration {state.iteration}", flush=True)
                return state
            if exit_duration_reached(args):  # --exit-duration-in-mins; collective
                if args.save and not saved:
                    _save(args, state)
                if metrics is not None:
                    print(f"exiting program after {args.exit_duration_in_mins} minutes at "
                          f"iteration {state.iteration}", flush=True)
                return state
        if (args.save and state.iteration > start_iteration
                and not (args.save_interval and state.iteration % args.save_interval == 0)):
            _save(args, state)
        _check_progress(state, start_iteration)
        if args.test_data_path:  # Megatron-LM evaluates the test set once, at the end
            test = evaluate(args, state, chunk_iterators(state.datasets[2], 0, args))
            if test is not None:
                state.last_test_loss = test
                if metrics is not None:
                    print(format_eval_lines(state.iteration, test, split="test"), flush=True)
                    metrics.evaluation(state.iteration, state.consumed_samples, test,
                                       split="test")
    finally:
        profiler.close()
        if metrics is not None:
            metrics.close()
    return state
