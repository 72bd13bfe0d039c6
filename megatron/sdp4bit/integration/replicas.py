"""qWD's invariant checked on a built model: are the model replicas bitwise identical?

Every data-parallel rank holds the same model replica (bitwise, by construction of the
weight all-gather). :func:`compare_replicas` computes a 64-bit checksum of every DDP bucket's
parameter buffer on each rank and the ranks compare them (one all-gather of a few integers
per group): the dense buckets over the data-parallel group, the expert-parallel buckets of a
MoE model over the expert data-parallel group (expert weights differ across the
expert-parallel ranks by design: each holds other experts). With TP > 1 the tensor-parallel
ranks also compare their copies of the weights TP does not split (layer norms,
row-parallel biases, position embeddings), which must be bitwise equal too: one checksum per
such parameter, one all-gather over the TP group. Cost: one read of the parameters.

Both trainers use it: ours every ``--check-replicas-interval`` iterations
(``training/guards/replicas.py``, which stops the run on a difference) and both end lines
(``lifecycle.py``), which print the verdict and this rank's checksum, so that two runs (a
resumed one and an uninterrupted one) can be compared bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron.sdp4bit.integration.buckets import dense_buffers, expert_buffers
from megatron.sdp4bit.integration.tp_duplicates import is_tp_duplicate

_CHUNK = 1 << 20
_MODULUS = (1 << 61) - 1


def checksum(data: torch.Tensor) -> int:
    """A position-weighted sum of the raw bits of ``data`` (1D), modulo 2**61 - 1: any change
    of one element changes it."""
    flat = data.view(-1)
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        flat.element_size()])
    total = 0
    for lo in range(0, flat.numel(), _CHUNK):
        chunk = bits[lo:lo + _CHUNK].to(torch.int64)
        weights = torch.arange(lo, lo + chunk.numel(), device=chunk.device) % 65521 + 1
        total = (total + int((chunk * weights).sum()) + int(chunk.sum())) % _MODULUS
    return total


@dataclasses.dataclass(frozen=True)
class ReplicaDifference:
    """The first copy that differs between the ranks of a group, and a rank where it does."""

    group: str
    """``DP``, ``expert DP`` or ``TP``."""
    what: str
    """``bucket 3 (N elements: name, name, ...)``, ``expert bucket 0 (...)``, or the name
    of a parameter TP does not split."""
    other: int
    """A rank of the group (its rank in the group) whose copy differs from rank 0's."""


@dataclasses.dataclass(frozen=True)
class ReplicaReport:
    """What :func:`compare_replicas` found."""

    checksum: int
    """This rank's checksum of every bucket's parameters (dense, then expert), folded."""
    data_parallel_size: int
    difference: ReplicaDifference | None
    """None: every copy is bitwise identical across its group."""


def _short(name: str) -> str:
    """A parameter's name without the wrappers' ``module.`` prefixes (DDP, Float16Module)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _buckets(model_chunks, expert: bool = False) -> list[tuple[object, str]]:
    """The dense buckets, or (``expert``) those of the expert-parallel buffers (MoE), each
    with the names of its first parameters."""
    out = []
    for chunk in model_chunks:
        names = {p: _short(n) for n, p in chunk.named_parameters()}
        for buffer in (expert_buffers(chunk) if expert else dense_buffers(chunk)):
            for bucket in buffer.buckets:
                first = sorted(names.get(p, "?") for p in bucket.params)[:2]
                out.append((bucket, ", ".join(first)))
    return out


def _first_disagreement(checksums: list[int], group, device: torch.device):
    """Collective over ``group``: the first index whose checksum differs between the group's
    ranks and a rank whose value differs from rank 0's, or None."""
    mine = torch.tensor(checksums, dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()  # [ranks, checksums]
    for i in range(table.shape[1]):
        column = table[:, i]
        if (column != column[0]).any():
            return i, int((column != column[0]).nonzero()[0])
    return None


def _compare_buckets(buckets, sums: list[int], group, device: torch.device,
                     name: str) -> ReplicaDifference | None:
    if dist.get_world_size(group) == 1:
        return None
    found = _first_disagreement(sums, group, device)
    if found is None:
        return None
    b, other = found
    bucket, names = buckets[b]
    what = "expert bucket" if name == "expert DP" else "bucket"
    return ReplicaDifference(name, f"{what} {b} ({bucket.param_data.numel()} elements: "
                                   f"{names}, ...)", other)


def _compare_tp_copies(model_chunks, device: torch.device) -> ReplicaDifference | None:
    """The TP ranks' copies of every parameter TP does not split are bitwise equal."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return None
    # expert weights (megatron-core marks them allreduce=False) are not TP-duplicated: with
    # expert TP 1 the TP ranks hold different experts
    copies = [(_short(name), param) for chunk in model_chunks
              for name, param in chunk.named_parameters()
              if is_tp_duplicate(param) and getattr(param, "allreduce", True)]
    if not copies:
        return None
    found = _first_disagreement([checksum(p.detach().reshape(-1)) for _, p in copies], group,
                                device)
    return None if found is None else ReplicaDifference("TP", copies[found[0]][0], found[1])


def compare_replicas(model_chunks) -> ReplicaReport:
    """Collective over the data-parallel group (and the expert data-parallel and
    tensor-parallel groups where they have more than one rank): compare every copy that
    must be bitwise identical; the first difference found, dense buckets first."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    dense, experts = _buckets(model_chunks), _buckets(model_chunks, expert=True)
    if not dense:
        return ReplicaReport(checksum=0, data_parallel_size=dp, difference=None)
    device = dense[0][0].param_data.device
    dense_sums = [checksum(b.param_data) for b, _ in dense]
    expert_sums = [checksum(b.param_data) for b, _ in experts]
    folded = 0
    for value in dense_sums + expert_sums:
        folded = (folded * 1_000_003 + value) % _MODULUS
    # Every comparison runs on every rank (a rank that stopped at its group's difference
    # would leave the ranks of other groups waiting in the next collective).
    found = [_compare_buckets(dense, dense_sums, parallel_state.get_data_parallel_group(),
                              device, "DP")]
    if experts:  # each expert's replicas live on the expert data-parallel group
        found.append(_compare_buckets(experts, expert_sums,
                                      parallel_state.get_expert_data_parallel_group(), device,
                                      "expert DP"))
    found.append(_compare_tp_copies(model_chunks, device))
    return ReplicaReport(checksum=folded, data_parallel_size=dp,
                         difference=next((d for d in found if d is not None), None))
