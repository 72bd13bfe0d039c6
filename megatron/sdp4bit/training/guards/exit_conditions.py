"""When the run ends early, agreed on by every rank: ``--exit-signal-handler``,
``--exit-interval``, ``--exit-duration-in-mins``.

:class:`ExitPolicy` asks, after every iteration, in Megatron-LM's order: the signal (its
handler is ``exit_signal.py``), then the interval, then the duration. The signal's and the
duration's checks are collectives over the default group, called by every rank after every
iteration, so all ranks stop after the same one. The flags are parsed in
``cli/megatron_flags.py``; ``cli/validate.py`` records ``args.start_time``. What is saved before the
exit is the checkpoint policy's (``training/checkpoint/policy.py``).
"""

from __future__ import annotations

import argparse
import time
from typing import NamedTuple

from megatron.sdp4bit.training.guards.exit_signal import ExitSignal


class Exit(NamedTuple):
    """Why the run stops after this iteration."""

    line: str
    """Megatron-LM's last line (printed by the logging rank)."""
    wait_for_save: bool
    """The signal's exit: its save is published before the line, which says what was saved
    (the others print first, and an asynchronous save is published when training ends)."""


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


class ExitPolicy:
    """Whether the run ends after an iteration (:meth:`due`, every rank, every iteration)."""

    def __init__(self, args: argparse.Namespace, signal: ExitSignal | None = None) -> None:
        self._args = args
        self._signal = signal

    def due(self, iteration: int) -> Exit | None:
        """Collective: the reason to stop after ``iteration``, or None to go on."""
        args = self._args
        if self._signal is not None and self._signal.agreed():
            return Exit(f"exiting program after receiving {self._signal.name} at iteration "
                        f"{iteration}", wait_for_save=True)
        if args.exit_interval and iteration % args.exit_interval == 0:
            return Exit(f"exiting program at iteration {iteration}", wait_for_save=False)
        if exit_duration_reached(args):
            return Exit(f"exiting program after {args.exit_duration_in_mins} minutes at "
                        f"iteration {iteration}", wait_for_save=False)
        return None
