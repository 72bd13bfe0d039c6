"""The space a save needs, checked before anything is written.

[Note: a full disk during a save]
A save that runs out of space part-way leaves a partial folder on the full disk (which makes
the next save fail too) and raises on whichever ranks hit the error, while the others wait in
the save's collectives. So the space is checked first: every rank adds up what it will write
(:func:`megatron.sdp4bit.integration.checkpoint_space.written_bytes` for torch_dist, the
tensor bytes of its file for the per-rank format), rank 0 compares the sum plus
:data:`MARGIN` with the free space of ``--save``, and a shortfall stops every rank before
a byte is written, in one line naming the folder, the space needed and the space free; the
last complete checkpoint stays current and loadable, and the run exits (docs/reliability.md).
A disk that fills during the save anyway (another job) fails megatron-core's writes: the
in-process writer hands the error on as megatron-core's writer processes do, megatron-core's
finalize step raises on every rank together, and :func:`failed_save` makes that one line
(rank 0 removes the partial folder first).
"""

from __future__ import annotations

import re
import shutil

import torch
import torch.distributed as dist

from megatron.sdp4bit.training.checkpoint import files
from megatron.sdp4bit.training.checkpoint.files import CheckpointError

_ERRNO = re.compile(r"\[Errno \d+\] ([^:'\"\]\n]+)")

# Metadata, the small objects and the file system's blocks on top of the tensors' bytes.
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 1 << 20


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_space(root: str, partial: str | None, iteration: int, local_bytes: int) -> None:
    """Collective: raise :class:`CheckpointError` on every rank when ``root`` lacks the space
    for a checkpoint whose ranks write ``local_bytes`` each (summed here); rank 0 removes
    ``partial`` (the empty folder the save made) first."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"  # NCCL's rule
    total = torch.tensor([local_bytes], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    needed = total.item() * (1 + MARGIN_FRACTION) + MARGIN_BYTES
    problem: list = [None]
    if dist.get_rank() == 0:
        free = shutil.disk_usage(root).free
        if free < needed:
            stays = _kept(root)
            problem[0] = (f"not saving iteration {iteration}: {root} has {_mib(free)} free, the "
                          f"checkpoint needs about {_mib(needed)}; {stays}; free space on its "
                          "file system (or give --save another folder) and resume")
            if partial is not None:
                shutil.rmtree(partial, ignore_errors=True)
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])


def _kept(root: str) -> str:
    try:
        kept = files.latest_iteration(root)
    except CheckpointError:  # a damaged tracker: the load names it
        kept = None
    return (f"iteration {kept} in {root} stays the current checkpoint" if kept is not None
            else f"{root} holds no complete checkpoint yet")


def failed_save(root: str, partial: str, iteration: int, err: BaseException, *,
                cause: str | None = None, fix: str | None = None) -> CheckpointError:
    """The one line for a save whose writes failed after the check (megatron-core raised on
    every rank together); rank 0 removes the partial folder first. ``cause`` and ``fix``:
    what happened and what to do, when it is known not to be the disk (an asynchronous
    save's writer that was killed or ran too long)."""
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    if cause is not None:
        return CheckpointError(f"saving iteration {iteration} to {root} failed: {cause}; its "
                               f"partial folder is removed and {_kept(root)}; {fix}")
    found = _ERRNO.search(str(err))
    free = shutil.disk_usage(root).free
    if found:
        reason = found.group(1).strip()
    elif free < MARGIN_BYTES:  # the error's text does not say (megatron-core 0.19's writer)
        reason = f"its file system is full: {_mib(free)} free"
    else:
        reason = "a rank could not write its files"
    return CheckpointError(f"saving iteration {iteration} to {root} failed ({reason}): its "
                           f"partial folder is removed and {_kept(root)}; free space on its "
                           "file system (or give --save another folder) and resume")


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in ``obj`` (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0

