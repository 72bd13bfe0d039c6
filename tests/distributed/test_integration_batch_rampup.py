"""--rampup-batch-size on the installed megatron-core release: its calculator gives every
iteration Megatron-LM's batch size (0.16.1's ramp-up class; on 0.19.2, which dropped it, the
step schedule that integration/microbatches.py writes). No processes: runs in both passes.

The oracle is Megatron-LM's formula written out here: with n = (G - START) / INCREMENT
increments, one every p = SAMPLES / n samples, the batch after c consumed samples is
START + INCREMENT * int(c / p), and G once c > SAMPLES."""

from __future__ import annotations

import random

import pytest

from megatron.sdp4bit.integration import microbatches


def _megatron_lm_size(start: int, increment: int, samples: int, gbs: int, consumed: int) -> int:
    n = (gbs - start) // increment
    if consumed > samples:
        return gbs
    return start + increment * int(consumed / (samples / n))


def _cases() -> list[tuple[int, int, int, int]]:
    rng = random.Random(0)
    cases = [(4, 4, 24, 12), (1, 1, 10, 4), (1, 1, 1, 4), (32, 32, 1000, 256),
             (16, 8, 3, 64)]  # fewer samples than increments: several steps at once
    for _ in range(300):
        increment, n, start = rng.randint(1, 7), rng.randint(1, 9), rng.randint(1, 20)
        cases.append((start, increment, rng.choice([rng.randint(1, 12), rng.randint(1, 500)]),
                      start + n * increment))
    return cases


def test_every_consumed_sample_gets_megatron_lm_s_batch_size() -> None:
    for start, increment, samples, gbs in _cases():
        calc = microbatches.build_calculator(gbs, 1, 1, (start, increment, samples))
        schedule = microbatches.step_schedule((start, increment, samples), gbs)
        assert schedule[0] == (0, start) and schedule[-1][1] == gbs
        assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(schedule, schedule[1:]))
        for consumed in range(samples + 3):
            want = _megatron_lm_size(start, increment, samples, gbs, consumed)
            calc.update(consumed, consistency_check=False)
            assert calc.get_current_global_batch_size() == want, (start, increment, samples,
                                                                  gbs, consumed)
            assert [s for c, s in schedule if c <= consumed][-1] == want


def test_the_global_calculator_counts_micro_batches_per_rank() -> None:
    """micro-batch 2 x 2 data-parallel ranks: a batch of 4k samples is k micro-batches; the
    global calculator is set again by every install (one run after another in a process)."""
    microbatches.install_calculator(12, 2, 2, (4, 4, 24), rank=1)
    got = [microbatches.current_batch(c) for c in (0, 11, 12, 23, 24, 10 ** 6)]
    assert got == [(4, 1), (4, 1), (8, 2), (8, 2), (12, 3), (12, 3)]
    microbatches.install_calculator(12, 2, 2, None, rank=1)
    assert microbatches.current_batch(0) == (12, 3)
    microbatches.install_calculator(16, 2, 2, (4, 2, 24), rank=1)
    try:
        with pytest.raises(AssertionError, match="not divisible"):  # the command line refuses it
            microbatches.current_batch(4)  # 6 samples: not whole micro-batches on 2 ranks
    finally:  # megatron-core's global: later tests of this process set their own
        from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator

        unset_num_microbatches_calculator()
