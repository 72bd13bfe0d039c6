"""Conditions that end the run early, agreed on by every rank: ``--exit-duration-in-mins``.

Each is a collective over the default group, called by every rank after every iteration
(``training/loop.py``), so all ranks stop after the same one. The signal-driven exit is
its own module (``exit_signal.py``); the flags are parsed in ``cli/megatron_flags.py``,
which also records ``args.start_time``.
"""

from __future__ import annotations

import argparse
import time


def exit_duration_reached(args: argparse.Namespace) -> bool:
    """``--exit-duration-in-mins``: whether any rank has run that long. Collective: every
    rank calls it after every iteration, so all stop after the same one."""
    if args.exit_duration_in_mins is None:
        return False
    import torch
    import torch.distributed as dist

    minutes = (time.time() - args.start_time) / 60.0
    # On the device whenever there is one (NCCL refuses host tensors), not only when the
    # default group's backend is called "nccl".
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    done = torch.tensor([int(minutes > args.exit_duration_in_mins)], dtype=torch.int32,
                        device=device)
    if dist.is_initialized():
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return bool(done.item())
