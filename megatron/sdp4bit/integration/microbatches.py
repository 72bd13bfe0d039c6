"""The global batch size and the number of micro-batches of each iteration: megatron-core's
calculator (``megatron.core.num_microbatches_calculator``), constant or ramped up.

:func:`build_calculator` makes one for a question asked before training (how many iterations
a ramp-up takes, which batch sizes it passes through); :func:`install_calculator` sets
megatron-core's global one, as Megatron-LM does at start-up, and :func:`current_batch`
updates it from the consumed samples and reads it, once per iteration.

[Note: the ramp-up on both releases]
Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES`` with ``--global-batch-size G``
has ``n = (G - START) / INCREMENT`` increments, one every ``p = SAMPLES / n`` samples (a
float): after ``c`` consumed samples the batch is ``START + INCREMENT * int(c / p)``, and
``G`` once ``c > SAMPLES``. megatron-core 0.16.1 ships that calculator
(``RampupBatchsizeNumMicroBatchesCalculator``). 0.19.2 removed it: its
``init_num_microbatches_calculator`` ignores ``rampup_batch_size`` (a deprecation warning,
then a constant batch) and offers a step schedule instead
(``StepBatchsizeNumMicroBatchesCalculator``: "THRESHOLD:SIZE ...", the size of the last
threshold <= c). :func:`step_schedule` writes the ramp-up as such a schedule: step k's
threshold is the first ``c`` at which 0.16.1's formula reaches k, found with the same
floating-point division, so both releases give every iteration the same batch size.
Which calculator a release has is looked up by name, not by version (as in releases.py).
"""

from __future__ import annotations

from megatron.core import num_microbatches_calculator as _nmc

__all__ = ["Rampup", "build_calculator", "current_batch", "install_calculator",
           "step_schedule"]

Rampup = tuple[int, int, int]
"""``--rampup-batch-size``: (start batch size, increment, ramp-up samples)."""

_RAMPUP_CLASS = "RampupBatchsizeNumMicroBatchesCalculator"  # 0.16.1
_STEP_CLASS = "StepBatchsizeNumMicroBatchesCalculator"  # 0.19.2


def step_schedule(rampup: Rampup, global_batch_size: int) -> list[tuple[int, int]]:
    """(first consumed sample, batch size) of every step of the ramp-up, the first at 0;
    see [Note: the ramp-up on both releases]. Needs ``START < G``, ``INCREMENT`` dividing
    ``G - START`` and ``SAMPLES >= 1`` (the command line checks them)."""
    start, increment, samples = rampup
    n = (global_batch_size - start) // increment
    per = samples / n  # 0.16.1's rampup_samples_per_increment

    def step(consumed: int) -> int:
        return n if consumed > samples else int(consumed / per)

    out = [(0, start)]
    for k in range(1, n + 1):
        c = max(int(k * per) - 1, 0)
        while c > 0 and step(c - 1) >= k:
            c -= 1
        while step(c) < k:
            c += 1
        size = start + k * increment
        if out[-1][0] == c:  # several steps at once (fewer samples than increments)
            out[-1] = (c, size)
        else:
            out.append((c, size))
    return out


def _schedule_text(schedule: list[tuple[int, int]]) -> str:
    return " ".join(f"{c}:{size}" for c, size in schedule)


def build_calculator(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                     rampup: Rampup | None = None, *,
                     rank: int = -1) -> _nmc.NumMicroBatchesCalculator:
    """A megatron-core calculator of its own (not the global one); ``rank`` 0 logs as
    megatron-core does, any other rank is quiet."""
    if rampup is None:
        return _nmc.ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size, False, rank)
    if hasattr(_nmc, _RAMPUP_CLASS):
        return getattr(_nmc, _RAMPUP_CLASS)(
            global_batch_size, micro_batch_size, data_parallel_size, False, rank, *rampup)
    return getattr(_nmc, _STEP_CLASS)(
        micro_batch_size, data_parallel_size, False, rank,
        _schedule_text(step_schedule(rampup, global_batch_size)))


def install_calculator(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                       rampup: Rampup | None = None, *, rank: int) -> None:
    """megatron-core's global calculator (what ``get_num_microbatches`` reads, in
    megatron-core too), set as Megatron-LM sets it; again on every call."""
    if rampup is not None and not hasattr(_nmc, _RAMPUP_CLASS):
        _nmc.reconfigure_num_microbatches_calculator(
            rank, None, global_batch_size, micro_batch_size, data_parallel_size, False,
            step_batch_size_schedule=_schedule_text(step_schedule(rampup, global_batch_size)))
        return
    _nmc.reconfigure_num_microbatches_calculator(
        rank, None if rampup is None else list(rampup), global_batch_size, micro_batch_size,
        data_parallel_size, False)


def current_batch(consumed_samples: int) -> tuple[int, int]:
    """(global batch size, micro-batches per data-parallel rank) of the iteration that starts
    after ``consumed_samples``, from the global calculator (:func:`install_calculator`)."""
    _nmc.update_num_microbatches(consumed_samples, consistency_check=True)
    return _nmc.get_current_global_batch_size(), _nmc.get_num_microbatches()
