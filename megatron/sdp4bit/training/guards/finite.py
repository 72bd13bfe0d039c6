"""One collective question asked before a step and before a save: is every value finite on
every rank? A NaN or Inf on any rank answers no on all of them, so all ranks act alike."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Collective over the default group: whether all ``tensors`` of all ranks are finite.

    One flag per tensor stays on its device; the host waits once, after the all-reduce
    (which runs on the device NCCL needs: the current CUDA device when there is one)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    flags = [(~torch.isfinite(t)).any().to(device) for t in tensors]
    bad = (torch.stack(flags).any().float().reshape(1) if flags
           else torch.zeros(1, device=device))
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())
