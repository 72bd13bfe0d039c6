"""Megatron-LM's observability flags: defaults and the one-line refusals of
training/cli/observe_flags.py (the run itself: tests/e2e/test_observe_run.py)."""

from __future__ import annotations

import pytest
import torch

from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data --train-iters 10").split()


def parse(extra: str):
    return parse_args(BASE + extra.split(), world_size=4)


def error(extra: str) -> str:
    with pytest.raises(ArgumentsError) as info:
        parse(extra)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_defaults_are_megatron_lms():
    args = parse("")
    assert (args.profile, args.use_pytorch_profiler, args.log_params_norm,
            args.log_num_zeros_in_grad, args.log_memory_to_tensorboard) == (False,) * 5
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [])
    args = parse("--profile --use-pytorch-profiler --tensorboard-dir /tmp/tb "
                 "--profile-step-start 0 --profile-step-end 2 --profile-ranks 1 3 "
                 "--log-params-norm --log-num-zeros-in-grad --log-memory-to-tensorboard")
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (0, 2, [1, 3])
    assert args.log_params_norm and args.log_num_zeros_in_grad and args.log_memory_to_tensorboard


@pytest.mark.parametrize("extra, message", [
    ("--log-memory-to-tensorboard", "--log-memory-to-tensorboard needs --tensorboard-dir (or "
     "--metrics-jsonl): memory is written there, not to the console"),
    ("--use-pytorch-profiler --profile-ranks 0", "--use-pytorch-profiler, --profile-ranks "
     "only take(s) effect with --profile: add --profile or drop them"),
    ("--profile-step-start 3", "--profile-step-start only take(s) effect with --profile: add "
     "--profile or drop them"),
    ("--profile --use-pytorch-profiler --tensorboard-dir /tmp/tb --profile-step-start 4 "
     "--profile-step-end 4", "--profile-step-start 4 and --profile-step-end 4: need 0 <= start "
     "< end"),
    ("--profile --use-pytorch-profiler --tensorboard-dir /tmp/tb --profile-step-start -1",
     "--profile-step-start -1 and --profile-step-end 12: need 0 <= start < end"),
    ("--profile --use-pytorch-profiler --tensorboard-dir /tmp/tb --profile-ranks 0 4 7",
     "--profile-ranks 4 7: not a rank of this run (0 to 3)"),
    ("--profile --use-pytorch-profiler", "--use-pytorch-profiler needs --tensorboard-dir: the "
     "trace is written there"),
    ("--pytorch-profiler-collect-shapes --record-shapes", "--pytorch-profiler-collect-shapes, "
     "--record-shapes only take(s) effect with --profile: add --profile or drop them"),
    ("--profile --use-pytorch-profiler --tensorboard-dir /tmp/tb --record-shapes",
     "--record-shapes is for the NVTX ranges of --profile without --use-pytorch-profiler: use "
     "--pytorch-profiler-collect-shapes"),
])
def test_refusals_name_the_flag(extra, message):
    assert error(extra) == message


def test_nsys_profiling_needs_cuda(monkeypatch):
    """Without --use-pytorch-profiler the window is CUDA's profiler API: refused without
    CUDA, accepted with it (the device is faked; only the check runs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert error("--profile") == (
        "--profile without --use-pytorch-profiler starts nsys's capture range "
        "(cudaProfilerStart), which needs CUDA: add --use-pytorch-profiler on CPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse("--profile --record-shapes").record_shapes
    assert error("--profile --pytorch-profiler-collect-callstack") == (
        "--pytorch-profiler-collect-shapes and --pytorch-profiler-collect-callstack need "
        "--use-pytorch-profiler")
