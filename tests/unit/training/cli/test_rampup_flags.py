"""--rampup-batch-size on the command line: the number of iterations Megatron-LM derives, and
every combination that cannot run refused in one line naming the flag."""

from __future__ import annotations

import pytest

from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data").split()


def parse(extra: str, world_size: int = 2):
    return parse_args(BASE + extra.split(), world_size=world_size)


def error(extra: str, world_size: int = 2) -> str:
    with pytest.raises(ArgumentsError) as info:
        parse(extra, world_size)
    assert "\n" not in str(info.value)
    return str(info.value)


def _megatron_lm_iterations(start: int, increment: int, samples: int, gbs: int,
                            train_samples: int) -> int:
    """Megatron-LM's ``update_train_iters`` with the ramp-up's formula (written out: the
    oracle, independent of megatron-core's calculator)."""
    n = (gbs - start) // increment
    iterations = consumed = 0
    while consumed <= samples and consumed <= train_samples:
        consumed += start + increment * int(consumed / (samples / n))
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


@pytest.mark.parametrize("rampup,gbs,train_samples", [
    ((4, 4, 24), 12, 60),  # 4 4 4 8 8 | 12 12: the walk ends past 24 samples, at 28
    ((4, 4, 24), 12, 28),  # nothing after the ramp-up: a partial batch is dropped
    ((4, 4, 24), 12, 10),  # --train-samples inside the ramp-up: 0, 4, 8 start iterations
    ((4, 4, 24), 12, 8),  # the iteration that starts at 8 still runs (Megatron-LM's <=)
    ((8, 4, 1000), 32, 5000),
    ((4, 8, 5), 68, 300),  # fewer samples than increments: several steps at once
], ids=lambda v: str(v).replace(" ", ""))
def test_iterations_are_megatron_lm_s(rampup, gbs, train_samples):
    args = parse(f"--global-batch-size {gbs} --train-samples {train_samples} "
                 f"--rampup-batch-size {' '.join(map(str, rampup))}")
    assert args.rampup_batch_size == list(rampup)
    assert args.train_iters == _megatron_lm_iterations(*rampup, gbs, train_samples)
    assert args.num_microbatches == gbs // 4  # evaluation's: the full global batch


def test_the_first_case_by_hand():
    args = parse("--global-batch-size 12 --train-samples 60 --rampup-batch-size 4 4 24")
    assert (args.train_iters, args.num_microbatches) == (7, 3)


@pytest.mark.parametrize("extra,message", [
    ("--global-batch-size 12 --train-iters 10 --rampup-batch-size 4 4 24",
     "--rampup-batch-size needs --train-samples: Megatron-LM ramps the batch size up in "
     "sample-based training only (the number of iterations follows from the growing "
     "batches); pass --train-samples instead of --train-iters"),
    ("--global-batch-size 12 --train-samples 60 --rampup-batch-size 0 4 24",
     "--rampup-batch-size 0 4 24: the start batch size, the increment and the ramp-up "
     "samples must each be >= 1"),
    ("--global-batch-size 12 --train-samples 60 --rampup-batch-size 4 0 24",
     "--rampup-batch-size 4 0 24: the start batch size, the increment and the ramp-up "
     "samples must each be >= 1"),
    ("--global-batch-size 12 --train-samples 60 --rampup-batch-size 4 4 0",
     "--rampup-batch-size 4 4 0: the start batch size, the increment and the ramp-up "
     "samples must each be >= 1"),
    ("--global-batch-size 12 --train-samples 60 --rampup-batch-size 12 4 24",
     "--rampup-batch-size 12 4 24: the start batch size must be less than "
     "--global-batch-size 12, the size it ramps up to"),
    ("--global-batch-size 12 --train-samples 60 --rampup-batch-size 4 3 24",
     "--rampup-batch-size 4 3 24: the increment must divide --global-batch-size 12 - start "
     "4 = 8"),
    ("--global-batch-size 12 --train-samples 3 --rampup-batch-size 4 4 24",
     "--train-samples=3 is less than the first batch of the ramp-up (4)"),
    ("--global-batch-size 16 --train-samples 60 --rampup-batch-size 6 2 24",
     "--rampup-batch-size: the ramp-up's global batch size 6 is not divisible by "
     "--micro-batch-size x data-parallel size = 2 x 2 = 4: use a start and an increment "
     "that are multiples of 4"),
    ("--global-batch-size 16 --train-samples 60 --rampup-batch-size 4 2 24",
     "--rampup-batch-size: the ramp-up's global batch size 6 is not divisible by "
     "--micro-batch-size x data-parallel size = 2 x 2 = 4: use a start and an increment "
     "that are multiples of 4"),
    ("--global-batch-size 12 --train-samples 60 --decrease-batch-size-if-needed",
     "--decrease-batch-size-if-needed is not supported by this trainer: batch sizes are "
     "never rounded down here (no sample is dropped): give a --global-batch-size and "
     "--rampup-batch-size sizes that --micro-batch-size x data-parallel size divides"),
])
def test_what_cannot_run_is_refused_in_one_line(extra, message):
    assert error(extra) == message


def test_sizes_the_run_never_reaches_are_not_checked():
    """The batch grows to 6 after 16.7 samples; --train-samples 15 ends the run at 16 after
    four batches of 4, so that the 6 never runs."""
    assert parse("--global-batch-size 16 --train-samples 15 --rampup-batch-size 4 2 100"
                 ).train_iters == 4


def test_the_interleaved_pipeline_needs_whole_pipeline_rounds_on_the_way():
    """PP 2 with 2 chunks on 8 ranks: 4 data-parallel ranks x micro-batch 2 = 8 samples per
    micro-batch round; the ramp-up's 8 is one micro-batch, not a multiple of PP 2."""
    extra = ("--num-layers 4 --pipeline-model-parallel-size 2 "
             "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 32 "
             "--train-samples 200 --rampup-batch-size {0} {0} 64")
    assert parse(extra.format(16), world_size=8).train_iters == 8  # 16 16 16 16 32 | 32 32 32
    assert error(extra.format(8), world_size=8) == (
        "--rampup-batch-size: the interleaved pipeline needs the number of micro-batches per "
        "step to be a multiple of --pipeline-model-parallel-size=2; the ramp-up's global "
        "batch size 8 has 1")
