"""Megatron-LM's observability flags: the parameter norm, zeros in the gradient, memory and
the profiling window.

Names, defaults and meaning are Megatron-LM's (``megatron/training/arguments.py`` and
``training.py``): ``--profile`` profiles iterations ``--profile-step-start`` to
``--profile-step-end`` on the ``--profile-ranks`` (default all); with
``--use-pytorch-profiler`` through torch.profiler, otherwise through CUDA's profiler API for
``nsys --capture-range=cudaProfilerApi``, which has no CPU counterpart. Where Megatron-LM
silently does nothing (a memory log without TensorBoard, a profiler option without
``--profile``), this trainer says so in one line.
"""

from __future__ import annotations

import argparse

import torch

from megatron.sdp4bit.training.cli.errors import ArgumentsError

__all__ = ["add_observe_flags", "check_observe_flags"]

PROFILE_STEP_START, PROFILE_STEP_END = 10, 12  # Megatron-LM's defaults


def add_observe_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-LM: logged statistics and profiling")
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of the parameters (of the optimizer's fp32 main "
                   "parameters with --bf16, as Megatron-LM) as 'params norm' and the "
                   "TensorBoard tag params-norm")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log the number of zero gradient entries as 'num zeros' and the "
                   "TensorBoard tag num-zeros")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="with --tensorboard-dir or --metrics-jsonl: the CUDA allocator's "
                   "statistics (mem-reserved-bytes, mem-allocated-bytes, "
                   "mem-max-allocated-bytes, mem-allocated-count); on CPU this process's "
                   "resident memory (mem-resident-bytes, mem-max-resident-bytes)")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start to --profile-step-end: with "
                   "--use-pytorch-profiler a torch.profiler trace under --tensorboard-dir, "
                   "otherwise (CUDA only) cudaProfilerStart/Stop and NVTX ranges for "
                   "nsys --capture-range=cudaProfilerApi")
    g.add_argument("--profile-step-start", type=int, default=None,
                   help=f"with --profile: the first profiled iteration (default "
                   f"{PROFILE_STEP_START})")
    g.add_argument("--profile-step-end", type=int, default=None,
                   help=f"with --profile: profiling stops after this iteration (default "
                   f"{PROFILE_STEP_END})")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=None,
                   help="with --profile: the global ranks that profile (default all)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch.profiler, whose trace TensorBoard's profiler "
                   "plugin opens")
    g.add_argument("--pytorch-profiler-collect-shapes", action="store_true",
                   help="with --use-pytorch-profiler: record the tensors' shapes")
    g.add_argument("--pytorch-profiler-collect-callstack", action="store_true",
                   help="with --use-pytorch-profiler: record the Python call stacks")
    g.add_argument("--record-shapes", action="store_true",
                   help="with --profile without --use-pytorch-profiler: the tensors' shapes "
                   "in the NVTX ranges")


def check_observe_flags(args: argparse.Namespace) -> None:
    """Refuse, in one line, what would do nothing or cannot run; fill the defaults."""
    if args.log_memory_to_tensorboard and not (args.tensorboard_dir or args.metrics_jsonl):
        raise ArgumentsError("--log-memory-to-tensorboard needs --tensorboard-dir (or "
                             "--metrics-jsonl): memory is written there, not to the console")
    if not args.profile:
        given = [flag for flag, value in (
            ("--use-pytorch-profiler", args.use_pytorch_profiler),
            ("--profile-step-start", args.profile_step_start is not None),
            ("--profile-step-end", args.profile_step_end is not None),
            ("--profile-ranks", args.profile_ranks is not None),
            ("--pytorch-profiler-collect-shapes", args.pytorch_profiler_collect_shapes),
            ("--pytorch-profiler-collect-callstack", args.pytorch_profiler_collect_callstack),
            ("--record-shapes", args.record_shapes)) if value]
        if given:
            raise ArgumentsError(f"{', '.join(given)} only take(s) effect with --profile: add "
                                 "--profile or drop them")
    start = PROFILE_STEP_START if args.profile_step_start is None else args.profile_step_start
    end = PROFILE_STEP_END if args.profile_step_end is None else args.profile_step_end
    args.profile_step_start, args.profile_step_end = start, end
    args.profile_ranks = list(args.profile_ranks or [])
    if not args.profile:
        return
    if start < 0 or end <= start:
        raise ArgumentsError(f"--profile-step-start {start} and --profile-step-end {end}: "
                             "need 0 <= start < end")
    wrong = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
    if wrong:
        raise ArgumentsError(f"--profile-ranks {' '.join(map(str, wrong))}: not a rank of "
                             f"this run (0 to {args.world_size - 1})")
    if args.use_pytorch_profiler:
        if args.record_shapes:
            raise ArgumentsError("--record-shapes is for the NVTX ranges of --profile without "
                                 "--use-pytorch-profiler: use --pytorch-profiler-collect-shapes")
        if not args.tensorboard_dir:
            raise ArgumentsError("--use-pytorch-profiler needs --tensorboard-dir: the trace "
                                 "is written there")
    elif args.pytorch_profiler_collect_shapes or args.pytorch_profiler_collect_callstack:
        raise ArgumentsError("--pytorch-profiler-collect-shapes and "
                             "--pytorch-profiler-collect-callstack need --use-pytorch-profiler")
    elif not torch.cuda.is_available():
        raise ArgumentsError("--profile without --use-pytorch-profiler starts nsys's capture "
                             "range (cudaProfilerStart), which needs CUDA: add "
                             "--use-pytorch-profiler on CPU")
