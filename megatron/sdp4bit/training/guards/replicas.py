"""``--check-replicas-interval N``: qWD's invariant checked in production, cheaply.

Every data-parallel rank holds the same model replica (bitwise, by construction of the
weight all-gather). Every N iterations each rank computes a 64-bit checksum of every DDP
bucket's parameter buffer, the DP ranks compare them (one all-gather of a few integers; the
expert-parallel buckets of a MoE model on their expert data-parallel group), and
the first bucket whose checksums differ stops the run with one line naming the bucket, its
first parameters and two ranks that disagree. With TP > 1 the tensor-parallel ranks also
compare their copies of the weights TP does not split (layer norms, row-parallel biases,
position embeddings), which must be bitwise equal too: one checksum per such parameter, one
all-gather over the TP group. Cost: one read of the parameters per check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.sdp4bit.integration.buckets import dense_buffers, expert_buffers
from megatron.sdp4bit.integration.tp_duplicates import is_tp_duplicate

_CHUNK = 1 << 20


class ReplicaMismatch(RuntimeError):
    """The replicas of the data-parallel ranks differ; the message names the bucket."""


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
        total = (total + int((chunk * weights).sum()) + int(chunk.sum())) % ((1 << 61) - 1)
    return total


def _short(name: str) -> str:
    """A parameter's name without the wrappers' ``module.`` prefixes (DDP, Float16Module)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _buckets(model_chunks, expert: bool = False) -> list[tuple[object, str]]:
    """The dense buckets, or (``expert``) those of the expert-parallel buffers (MoE)."""
    out = []
    for chunk in model_chunks:
        names = {p: _short(n) for n, p in chunk.named_parameters()}
        for buffer in (expert_buffers(chunk) if expert else dense_buffers(chunk)):
            for bucket in buffer.buckets:
                first = sorted(names.get(p, "?") for p in bucket.params)[:2]
                out.append((bucket, ", ".join(first)))
    return out


def gather_pending(overlap_param_gather: bool, quantized_weights: bool) -> bool:
    """Whether the parameter all-gather of the last step is still to come when the step
    returns. With ``--overlap-param-gather`` megatron-core's optimizer writes each rank's
    own shard into the replica and leaves the all-gather to the next forward pass: until
    then the replicas differ by design. qWD's optimizer leaves the replica alone (its
    all-gather applies the weight difference), so there it stays identical meanwhile and the
    check needs no all-gather."""
    return overlap_param_gather and not quantized_weights


def check_replicas(model_chunks, iteration: int, *, finish_gather: bool = False) -> None:
    """Collective over the data-parallel group; raises :class:`ReplicaMismatch`.
    ``finish_gather`` (see :func:`gather_pending`) first completes the parameter all-gather
    of the step, as megatron-core does before a checkpoint."""
    if finish_gather:
        for chunk in model_chunks:
            chunk.start_param_sync(force_sync=True)
    buckets = _buckets(model_chunks)
    if not buckets:
        return
    device = buckets[0][0].param_data.device
    _check_group(buckets, parallel_state.get_data_parallel_group(), iteration, device,
                 "data-parallel ranks", "DP")
    experts = _buckets(model_chunks, expert=True)
    if experts:  # each expert's replicas live on the expert data-parallel group
        _check_group(experts, parallel_state.get_expert_data_parallel_group(), iteration,
                     device, "expert data-parallel ranks", "expert DP")
    _check_tp_copies(model_chunks, iteration, device)


def _check_group(buckets, group, iteration: int, device: torch.device, ranks: str,
                 short: str) -> None:
    if dist.get_world_size(group) == 1:
        return
    found = _first_disagreement([checksum(b.param_data) for b, _ in buckets], group, device)
    if found is not None:
        b, other = found
        bucket, names = buckets[b]
        what = "expert bucket" if short == "expert DP" else "bucket"
        raise ReplicaMismatch(
            f"model replicas differ across {ranks} at iteration {iteration}: "
            f"{what} {b} ({bucket.param_data.numel()} elements: {names}, ...) differs "
            f"between {short} ranks 0 and {other}; the run stops (a bug or a hardware fault: "
            "resume from the last checkpoint)")


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


def _check_tp_copies(model_chunks, iteration: int, device: torch.device) -> None:
    """The TP ranks' copies of every parameter TP does not split are bitwise equal."""
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    # expert weights (megatron-core marks them allreduce=False) are not TP-duplicated: with
    # expert TP 1 the TP ranks hold different experts
    copies = [(_short(name), param) for chunk in model_chunks
              for name, param in chunk.named_parameters()
              if is_tp_duplicate(param) and getattr(param, "allreduce", True)]
    if not copies:
        return
    found = _first_disagreement([checksum(p.detach().reshape(-1)) for _, p in copies], group,
                                device)
    if found is not None:
        i, other = found
        raise ReplicaMismatch(
            f"the tensor-parallel ranks' copies of {copies[i][0]} (a weight TP does not split) "
            f"differ at iteration {iteration}: TP ranks 0 and {other}; the run stops (a "
            "bug or a hardware fault: resume from the last checkpoint)")
