"""What the loop reports after each iteration and evaluation, as Megatron-LM's trainer does.

After every step: the parameter norm (``--log-params-norm``) and the MoE routers' losses
(collectives, every rank), the end of SDP4Bit's iteration (its lifecycle counts the bytes of
megatron-core's collectives that SDP4Bit did not replace), and the per-iteration
TensorBoard/W&B scalars (``observe/metrics_writer.py``). Every
``--log-interval`` iterations: the training line (``observe/logging.py``), its
timers block (collective) and the metrics file's record, averaged over the interval. After
an evaluation: its lines and scalars; its time is not counted as iteration time. Only the
logging rank (the last) prints and writes.
"""

from __future__ import annotations

import argparse
import time

from megatron.sdp4bit.integration.params_norm import params_l2_norm
from megatron.sdp4bit.training.observe.comm_counters import log_fields
from megatron.sdp4bit.training.observe.logging import (
    format_eval_lines,
    format_train_line,
    is_logging_rank,
)
from megatron.sdp4bit.training.observe.memory import memory_scalars
from megatron.sdp4bit.training.observe.metrics_writer import MetricsWriter
from megatron.sdp4bit.training.observe.moe_metrics import MoELosses
from megatron.sdp4bit.training.observe.timers import format_timers, max_times


def flops_per_iteration(args: argparse.Namespace, vocab: int, batch_size: int) -> float:
    """Model FLOPs of one training iteration of ``batch_size`` samples (forward + backward =
    3 x forward matmuls)."""
    h, s, L, f = args.hidden_size, args.seq_length, args.num_layers, args.ffn_hidden_size
    mlp = (3 if args.swiglu else 2) * h * f
    per_token = L * (2 * (4 * h * h + mlp) + 4 * s * h) + 2 * h * vocab
    return 3.0 * per_token * batch_size * s


class MetricsStep:
    """The loop's reporting (see the module docstring); :meth:`close` when training ends."""

    def __init__(self, args: argparse.Namespace, state) -> None:
        self._args = args
        self._state = state
        self._writer = MetricsWriter(args) if is_logging_rank() else None
        self._moe = MoELosses(args)
        self._new_window()

    def _new_window(self) -> None:
        self._loss, self._iterations, self._start = 0.0, 0, time.time()
        self._skipped = self._nan = 0

    def after_step(self, loss: float, grad_norm: float, ok: bool, num_zeros: float | None,
                   batch_size: int, num_microbatches: int) -> None:
        """After iteration ``state.iteration`` (already counted) of ``batch_size`` samples."""
        args, state = self._args, self._state
        # Megatron-LM computes it every iteration, on every rank (collective)
        params_norm = params_l2_norm(state.model, args.bf16) if args.log_params_norm else None
        state.lifecycle.finish_iteration()  # megatron-core's own collectives, counted
        self._moe.after_iteration(state.iteration, num_microbatches)
        if state.first_loss is None:
            state.first_loss, state.first_loss_iteration = loss, state.iteration
        state.last_loss = loss
        self._loss += loss
        self._iterations += 1
        self._skipped += 0 if ok else 1
        self._nan += 0 if loss == loss else 1
        writer = self._writer
        if writer is not None and writer.iteration_due(state.iteration):
            # Megatron-LM's per-iteration TensorBoard/W&B scalars
            writer.iteration(state.iteration, state.consumed_samples, loss,
                             state.optimizer.param_groups[0]["lr"],
                             state.optimizer.get_loss_scale().item(), float(grad_norm),
                             num_zeros=num_zeros, params_norm=params_norm,
                             batch_size=batch_size)
        if state.iteration % args.log_interval == 0:
            self._log_line(grad_norm, num_zeros, params_norm, batch_size)

    def _log_line(self, grad_norm: float, num_zeros: float | None,
                  params_norm: float | None, batch_size: int) -> None:
        args, state = self._args, self._state
        n = self._iterations
        elapsed = (time.time() - self._start) / n
        comm = log_fields(state.lifecycle.take_bytes().per_iteration(n))
        record = {
            "iteration": state.iteration, "train_iters": args.train_iters,
            "time": round(time.time(), 3),
            "consumed_samples": state.consumed_samples, "elapsed_ms": elapsed * 1e3,
            "tflops_per_gpu": flops_per_iteration(args, state.vocab_size, batch_size)
            / (elapsed * args.world_size * 1e12),
            "learning_rate": state.optimizer.param_groups[0]["lr"],
            "global_batch_size": batch_size, "lm_loss": self._loss / n,
            "loss_scale": state.optimizer.get_loss_scale().item(),
            "grad_norm": float(grad_norm), "skipped_iterations": self._skipped,
            "nan_iterations": self._nan, **comm, **self._moe.take(n),
        }
        # this iteration's values, as Megatron-LM's line shows them
        if args.log_num_zeros_in_grad:
            record["num_zeros"] = num_zeros
        if params_norm is not None:
            record["params_norm"] = params_norm
        if args.log_memory_to_tensorboard and self._writer is not None:
            record["memory"] = memory_scalars()
        timer_block = None
        if state.timers is not None:  # collective: every rank takes part
            for phase, seconds in state.lifecycle.take_seconds().items():
                state.timers.add(f"sdp4bit-{phase}", seconds)
            times = state.timers.collect(normalizer=n)
            record["timers_ms"] = max_times(times)
            timer_block = format_timers(times, args.timing_log_option)
        if self._writer is not None:
            print(format_train_line(record), flush=True)
            if timer_block:
                print(timer_block, flush=True)
            self._writer.train(record)
        self._new_window()

    def evaluated(self, loss: float | None, split: str = "validation") -> None:
        """After an evaluation (``loss`` None: no data for it)."""
        state = self._state
        if loss is not None:
            if split == "validation":
                state.last_val_loss = loss
            else:
                state.last_test_loss = loss
            if self._writer is not None:
                print(format_eval_lines(state.iteration, loss, split=split), flush=True)
                self._writer.evaluation(state.iteration, state.consumed_samples, loss,
                                        split=split)
        self._start = time.time()  # evaluation time is not iteration time

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
