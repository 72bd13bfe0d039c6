"""``--rampup-batch-size START INCREMENT SAMPLES``: Megatron-LM's batch-size ramp-up.

The global batch size starts at START and grows by INCREMENT until it reaches
``--global-batch-size``, over SAMPLES consumed samples (megatron-core's calculator decides
each iteration's size from the consumed samples: integration/microbatches.py). As in
Megatron-LM (its ``update_train_iters`` and train loop):

* it needs sample-based training (``--train-samples``); the number of iterations is counted
  by walking the ramp-up: iterations start while the consumed samples are at most SAMPLES
  (and at most ``--train-samples``), each adding the batch size of its start; the rest of
  ``--train-samples`` is divided by ``--global-batch-size`` (a partial last batch dropped);
* every iteration consumes its own batch size; the learning-rate and weight-decay schedules
  advance by it (they count samples); the log line's "global batch size" shows it;
* evaluation uses the full ``--global-batch-size`` (Megatron-LM's ``evaluate``).

Refused here rather than by an assertion in the middle of a run: a batch size on the way
that ``--micro-batch-size`` x data-parallel size does not divide (Megatron-LM's own
consistency check), and, with the interleaved pipeline, one whose number of micro-batches
is not a multiple of the pipeline size.
"""

from __future__ import annotations

import argparse

from megatron.sdp4bit.training.cli.errors import ArgumentsError

__all__ = ["check_rampup_sizes", "check_rampup_values", "rampup_iterations"]

FLAG = "--rampup-batch-size"


def _fail(message: str) -> None:
    raise ArgumentsError(message)


def _walk(args: argparse.Namespace, data_parallel_size: int) -> tuple[int, list[int]]:
    """(iterations, the batch size of each ramp-up iteration): Megatron-LM's
    ``update_train_iters`` on megatron-core's calculator."""
    # At call time, as every import of integration/ here: it loads megatron-core, which
    # importing the command line must not (docs/design.md, section 7).
    from megatron.sdp4bit.integration.microbatches import build_calculator

    start, _, samples = args.rampup_batch_size
    calculator = build_calculator(args.global_batch_size, args.micro_batch_size,
                                  data_parallel_size, tuple(args.rampup_batch_size))
    sizes, consumed = [], 0
    while consumed <= samples and consumed <= args.train_samples:
        calculator.update(consumed, consistency_check=False)
        sizes.append(calculator.get_current_global_batch_size())
        consumed += sizes[-1]
    iterations = len(sizes)
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations, sizes


def check_rampup_values(args: argparse.Namespace) -> None:
    """The flag's three values against --train-samples and ``args.global_batch_size`` (set,
    unless without --train-samples, which is refused first)."""
    start, increment, samples = args.rampup_batch_size
    given = f"{FLAG} {start} {increment} {samples}"
    if args.train_samples is None:
        _fail(f"{FLAG} needs --train-samples: Megatron-LM ramps the batch size up in "
              "sample-based training only (the number of iterations follows from the "
              "growing batches); pass --train-samples instead of --train-iters")
    if min(start, increment, samples) < 1:
        _fail(f"{given}: the start batch size, the increment and the ramp-up samples must "
              "each be >= 1")
    gbs = args.global_batch_size
    if start >= gbs:
        _fail(f"{given}: the start batch size must be less than --global-batch-size {gbs}, "
              "the size it ramps up to")
    if (gbs - start) % increment:
        _fail(f"{given}: the increment must divide --global-batch-size {gbs} - start {start} "
              f"= {gbs - start}")
    if args.train_samples < start:
        _fail(f"--train-samples={args.train_samples} is less than the first batch of the "
              f"ramp-up ({start})")


def rampup_iterations(args: argparse.Namespace, data_parallel_size: int) -> int:
    """Check the flag's values and return the run's number of iterations (``--train-iters``
    as Megatron-LM derives it). ``args.global_batch_size`` must be set."""
    check_rampup_values(args)
    return _walk(args, data_parallel_size)[0]


def check_rampup_sizes(args: argparse.Namespace) -> None:
    """Every batch size the run passes through divides into micro-batches (and, with the
    interleaved pipeline, into a multiple of the pipeline size of them). Needs
    ``args.data_parallel_size``."""
    if args.rampup_batch_size is None:
        return
    _, sizes = _walk(args, args.data_parallel_size)
    per_step = args.micro_batch_size * args.data_parallel_size
    pp = args.pipeline_model_parallel_size
    for size in sizes:
        if size % per_step:
            _fail(f"{FLAG}: the ramp-up's global batch size {size} is not divisible by "
                  f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x "
                  f"{args.data_parallel_size} = {per_step}: use a start and an increment that "
                  f"are multiples of {per_step}")
        if args.virtual_pipeline_model_parallel_size is not None and (size // per_step) % pp:
            _fail(f"{FLAG}: the interleaved pipeline needs the number of micro-batches per "
                  f"step to be a multiple of --pipeline-model-parallel-size={pp}; the "
                  f"ramp-up's global batch size {size} has {size // per_step}")
