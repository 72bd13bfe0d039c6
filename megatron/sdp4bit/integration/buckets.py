"""What SDP4Bit knows about each megatron-core bucket, in one record built once at install.

Bucket ids are assigned in bucket order over the model chunks' bucket groups, so they are
identical on the DP ranks of a group (every rank has the same layout). Every consumer (the
collectives' seeds, the main shards of qWD, the TP-duplicate offsets, the byte accounting)
reads the same :class:`BucketInfo`.

[Note: the dense and the expert-parallel buffers]
megatron-core's ``DistributedDataParallel`` keeps a mixture-of-experts model's parameters in
two lists of buffers: ``buffers`` (the dense ones, on the data-parallel group) and
``expert_parallel_buffers`` (the experts', on the expert data-parallel group; empty for a
dense model). A walk over ``chunk.buffers`` alone misses the experts: the trainer's finite
check once did, and a NaN only in the expert gradients was applied (the model NaN from then
on). Every walk over a model's buffers goes through :func:`all_buffers` (both lists), or
:func:`dense_buffers` / :func:`expert_buffers` where the two live on different groups (the
replica check) or only one can hold what is sought (TP-duplicated weights are dense), with a
comment saying why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from megatron.sdp4bit.comm import check_padded, divisor_from_config
from megatron.sdp4bit.config import SDP4BitConfig


@dataclasses.dataclass(frozen=True)
class BucketInfo:
    """One bucket of a DDP buffer, as SDP4Bit sees it."""

    id: int
    """Stable id: the bucket's place in bucket order (the same on every DP rank)."""
    dp_rank: int
    """This rank's rank in the bucket group's DP group (its shard index)."""
    world: int
    """The DP group's size (shards per bucket)."""
    numel: int
    """Elements of the bucket, padded (``grad_data`` / ``param_data``)."""
    numel_unpadded: int
    """Elements of its parameters, without megatron-core's and SDP4Bit's end padding."""
    divisor: int
    """What the bucket was padded to a multiple of (``comm.divisor_from_config``)."""
    bucket: object = dataclasses.field(repr=False, compare=False)
    """megatron-core's bucket object."""

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world

    @property
    def shard_start(self) -> int:
        """Where this rank's shard starts in the bucket."""
        return self.dp_rank * self.shard_numel

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.shard_numel

    @property
    def padding(self) -> int:
        """Elements of padding at the bucket's end."""
        return self.numel - self.numel_unpadded


class Buckets:
    """Every :class:`BucketInfo` of one install, found by id or by megatron-core's bucket."""

    def __init__(self, infos: Iterable[BucketInfo]) -> None:
        self._infos = tuple(infos)
        self._by_object = {id(info.bucket): info for info in self._infos}

    def __iter__(self) -> Iterator[BucketInfo]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def by_id(self, bucket_id: int) -> BucketInfo:
        return self._infos[bucket_id]

    def of(self, bucket: object) -> BucketInfo:
        """The record of megatron-core's ``bucket``."""
        return self._by_object[id(bucket)]


def bucket_infos(bucket_groups: Iterable, config: SDP4BitConfig) -> Buckets:
    """One :class:`BucketInfo` per bucket of ``bucket_groups``, in order; ``ValueError`` for
    a bucket not padded to the quantizers' divisor (built outside ``sdp4bit_padding``)."""
    infos = []
    for group in bucket_groups:
        world = group.intra_distributed_optimizer_instance_size
        rank = group.intra_distributed_optimizer_instance_rank
        divisor = divisor_from_config(config, world)
        for bucket in group.buckets:
            info = BucketInfo(id=len(infos), dp_rank=rank, world=world,
                              numel=bucket.grad_data.numel(),
                              numel_unpadded=bucket.numel_unpadded, divisor=divisor,
                              bucket=bucket)
            check_padded(info.numel, divisor,
                         f"bucket {info.id} (build DistributedDataParallel inside "
                         "megatron.sdp4bit.integration.sdp4bit_padding(config) to pad it)")
            infos.append(info)
    return Buckets(infos)


def main_shard_numel(buffers: Iterable) -> int:
    """Elements of the fp32 main parameters that this rank's distributed optimizer keeps for
    the DDP ``buffers`` (its shard of each bucket, parameter by parameter), from
    megatron-core's own shard ranges (``DistributedOptimizer._build_gbuf_range_map``, a
    classmethod: no optimizer and no collective needed), so that a caller can size a layout
    it never steps (``benchmarks/scale.py``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return sum(r["param"].size for buffer in buffers
               for ranges in DistributedOptimizer._build_gbuf_range_map(buffer).values()
               for bucket in ranges for r in bucket["param_map"].values())


def dense_buffers(chunk) -> list:
    """megatron-core DDP ``chunk``'s dense buffers (on the data-parallel group)."""
    return list(chunk.buffers)


def expert_buffers(chunk) -> list:
    """``chunk``'s expert-parallel buffers (MoE, on the expert data-parallel group); empty for
    a dense model."""
    return list(getattr(chunk, "expert_parallel_buffers", None) or [])


def all_buffers(model_chunks: Iterable) -> Iterator:
    """Every buffer of every chunk, dense then expert-parallel ([Note: the dense and the
    expert-parallel buffers])."""
    for chunk in model_chunks:
        yield from dense_buffers(chunk)
        yield from expert_buffers(chunk)
