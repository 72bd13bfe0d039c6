"""``--log-memory-to-tensorboard``: this process's memory, under Megatron-LM's tags.

On CUDA the caching allocator's statistics, as Megatron-LM's ``training_log`` writes them
(``mem-reserved-bytes``, ``mem-allocated-bytes``, ``mem-max-allocated-bytes``,
``mem-allocated-count``). Without CUDA there is no allocator to ask: the process's resident
memory stands in (``mem-resident-bytes``, from ``/proc/self/statm``, and
``mem-max-resident-bytes``, the peak from ``getrusage``), tags Megatron-LM does not have.
"""

from __future__ import annotations

import os
import resource

import torch

__all__ = ["memory_scalars"]


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_scalars() -> dict[str, float]:
    """TensorBoard tag -> bytes (or a count) for this process, now."""
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    now = _resident_bytes()
    # getrusage's peak (KiB on Linux) is counted by the kernel's accounting, which can trail
    # /proc's current figure by some pages: the peak is at least what is resident now.
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, now)
    return {"mem-resident-bytes": now, "mem-max-resident-bytes": peak}
