"""Weights that tensor parallelism does not split stay bitwise equal on every TP rank.

[Note: TP-duplicated weights]
With TP > 1 every TP rank holds a whole copy of the parameters TP does not split: layer
norms, the biases of row-parallel layers, position embeddings (megatron-core leaves
``tensor_model_parallel`` unset on them). Unquantized, the copies stay bitwise equal by
construction: they start equal, every TP rank computes the same gradient for them (or
megatron-core all-reduces it over the TP group: sequence-parallel layer norms), and each TP
rank's DP group reduces identical values the same way.

SDP4Bit breaks that: a quantization group holds a duplicated element next to elements of
the rank's own TP shards (other values on each TP rank, so another group scale), and each
DP group draws its own rounding noise. The copies would take different rounding errors in
both collectives and drift apart (measured: 1.5 bf16 steps after 4 iterations at TP 2), the
checkpoint would store one of several copies, and a same-layout resume would not be exact.

Every TP rank's buckets have the same layout (its TP shards have the same shapes as the
other ranks'), so a duplicated element sits at the same bucket offset, in the same DP shard,
on every TP rank. Two broadcasts from TP rank 0 over the TP group make the copies agree:

* gradients: in the distributed optimizer's ``_copy_model_grads_to_main_grads``, before it
  reads the reduced shard (and after megatron-core's own TP all-reduces of
  ``finalize_model_grads``), the duplicated elements of this rank's shard of every bucket.
  The optimizer then sees the same gradients, and Adam keeps the fp32 main weights and its
  moments equal (elementwise, with the same global scalars);
* weights: when a qWD all-gather of a bucket has landed, the bucket's duplicated elements
  of ``param_data`` (16-bit).

TP rank 0 keeps exactly what it computed; the other TP ranks take its values. The cost is one
unquantized message per step of the duplicated gradients of a shard and one per bucket of the
duplicated weights, inside the TP group (inside a node, where TP runs): for a GPT with
learned positions about (6 L h + s h) elements, for RoPE + RMSNorm models 2 L h.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.sdp4bit.integration.buckets import Buckets, dense_buffers


def is_tp_duplicate(param: torch.nn.Parameter) -> bool:
    """A parameter every TP rank holds whole (megatron-core marks split ones)."""
    return not getattr(param, "tensor_model_parallel", False)


@dataclass
class TPDuplicates:
    """Where the duplicated elements lie, per bucket id, and the TP group that syncs them."""

    group: object  # the TP process group
    src: int  # global rank of TP rank 0 of this rank's TP group
    bucket_offsets: dict[int, torch.Tensor] = field(default_factory=dict)
    """Bucket id -> int64 offsets in the bucket of its duplicated elements (sorted)."""
    shard_offsets: dict[int, torch.Tensor] = field(default_factory=dict)
    """Bucket id -> int64 offsets in this rank's DP shard of the bucket (sorted)."""

    def sync_weights(self, bucket_id: int, param_data: torch.Tensor) -> None:
        """Give ``param_data``'s duplicated elements TP rank 0's values."""
        offsets = self.bucket_offsets.get(bucket_id)
        if offsets is not None:
            _broadcast_elements(param_data, offsets, self.src, self.group)

    def sync_gradients(self, shards: list[tuple[int, torch.Tensor]]) -> None:
        """Give the duplicated elements of each ``(bucket id, grad shard)`` TP rank 0's
        values, in one message."""
        pieces = [(shard, self.shard_offsets[bid]) for bid, shard in shards
                  if bid in self.shard_offsets]
        if not pieces:
            return
        dtypes = {shard.dtype for shard, _ in pieces}
        for dtype in sorted(dtypes, key=str):  # one message per gradient dtype
            same = [(s, o) for s, o in pieces if s.dtype == dtype]
            values = torch.cat([s.index_select(0, o) for s, o in same])
            dist.broadcast(values, src=self.src, group=self.group)
            start = 0
            for shard, offsets in same:
                shard.index_copy_(0, offsets, values[start:start + offsets.numel()])
                start += offsets.numel()


def _broadcast_elements(data: torch.Tensor, offsets: torch.Tensor, src: int, group) -> None:
    values = data.index_select(0, offsets)
    dist.broadcast(values, src=src, group=group)
    data.index_copy_(0, offsets, values)


def tp_duplicates(model_chunks, buckets: Buckets) -> TPDuplicates | None:
    """The duplicated elements of every bucket of ``model_chunks``, or None with TP = 1.

    Offsets come from each buffer's ``param_index_map`` (param -> start and end in the
    buffer), less the bucket's ``offset`` in it.
    """
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    found = TPDuplicates(group=parallel_state.get_tensor_model_parallel_group(),
                         src=parallel_state.get_tensor_model_parallel_src_rank())
    for chunk in model_chunks:
        # dense only: expert weights are not TP-duplicated (with expert TP 1 the TP ranks
        # hold different experts)
        for buffer in dense_buffers(chunk):
            for bucket in buffer.buckets:
                info = buckets.of(bucket)
                ranges = []
                for param in bucket.params_list:
                    if is_tp_duplicate(param):
                        start, end, _ = buffer.param_index_map[param]
                        ranges.append(torch.arange(start - bucket.offset, end - bucket.offset))
                if not ranges:
                    continue
                device = bucket.grad_data.device
                offsets = torch.cat(ranges).sort().values
                first = info.shard_start
                mine = offsets[(offsets >= first) & (offsets < info.shard_end)] - first
                found.bucket_offsets[info.id] = offsets.to(device)
                if mine.numel():
                    found.shard_offsets[info.id] = mine.to(device)
    return found
